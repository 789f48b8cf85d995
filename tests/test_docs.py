"""The README stays a front page and the docs stay whole: the README within 15 KiB with the two commands CI and a
fresh machine depend on, word for word; every relative link of the README and of docs/*.md naming a file that
exists (a docs page's within docs/, the only folder the site is built from), mkdocs.yml's nav naming every page;
and docs/results.md's column table listing exactly the columns the code writes, so a column added without a
description fails here. Reads files only (no model, no point): well under 2 s."""

import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, load_script

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
INSTALL_AND_RUN = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m vlmprobe +sweep=seq_len'
TEST_COMMAND = 'python -m pytest -q -m "not slow" -n 2'
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)\)")


def fenced_blocks(text: str) -> list[str]:
    """The contents of the ```bash blocks of a Markdown text."""
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """A Markdown text without its fenced blocks and code spans, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(text: str) -> list[str]:
    """Link targets that name a file of the repository: no scheme, no bare anchor; the anchor cut off."""
    targets = [t.split("#")[0] for t in LINK.findall(prose(text))]
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_link_finder_finds_links_and_skips_code_urls_and_anchors():
    text = ("See [a](a.md), [b](docs/b.md#part) and ![img](c.png).\n`[d](d.md)` [e](https://x.org/e.md) [f](#g)\n"
            "```\n[h](h.md)\n```\n")
    assert relative_links(text) == ["a.md", "docs/b.md"]


def test_the_readme_is_at_most_15_kib_and_keeps_the_two_commands_word_for_word():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= 15 * 1024
    commands = [line for block in fenced_blocks(text) for line in block.splitlines()]
    assert INSTALL_AND_RUN in commands and TEST_COMMAND in commands
    # the test command is the one CI runs (.ci/run), and the install the steps CI makes
    ci = (REPO / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci and "pip install --quiet torch==2.13.0" in ci and '-e ".[test]"' in ci


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_names_a_file_that_exists(path):
    broken = [t for t in relative_links(path.read_text(encoding="utf-8")) if not (path.parent / t).exists()]
    assert not broken
    if path.parent == DOCS:  # the site holds docs/ only: a page's link out of it would not resolve there
        outside = [t for t in relative_links(path.read_text(encoding="utf-8"))
                   if DOCS.resolve() not in (path.parent / t).resolve().parents]
        assert not outside


def test_the_site_navigation_names_every_docs_page_once():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(entries):
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    named = list(pages(config["nav"]))
    assert sorted(named) == [p.name for p in PAGES] and len(named) == len(set(named))


def column_table(page: str, markers) -> list[list[str]]:
    begin, end = page.index(markers[0]), page.index(markers[1])
    rows = [line for line in page[begin:end].splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_column_table_lists_exactly_the_columns_the_code_writes():
    from vlmprobe.results.table import INPUT_COLUMNS, OUTPUT_COLUMNS, RANK_COLUMNS

    columns_doc = load_script("columns_doc")
    rows = column_table((DOCS / "results.md").read_text(encoding="utf-8"), columns_doc.MARKERS)
    listed = [row[0].strip("`") for row in rows]
    expected = INPUT_COLUMNS + OUTPUT_COLUMNS + [c for c in RANK_COLUMNS if c not in INPUT_COLUMNS + OUTPUT_COLUMNS]
    assert listed == expected
    assert all(row[2] for row in rows)  # each with its meaning
    # ranks.csv's columns are marked so, and only they
    assert {row[0].strip("`") for row in rows if "ranks.csv" in row[1]} == set(RANK_COLUMNS)
    assert columns_doc.main(["--check"]) == 0  # the section is what the script writes from today's descriptions


def test_a_column_without_a_description_stops_the_script_in_one_line(monkeypatch, capsys):
    columns_doc = load_script("columns_doc")
    monkeypatch.setattr(columns_doc, "OUTPUT_COLUMNS", [*columns_doc.OUTPUT_COLUMNS, "new_peak_bytes"])
    with pytest.raises(KeyError, match="new_peak_bytes"):
        columns_doc.render()
    assert columns_doc.main(["--check"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("columns_doc: column 'new_peak_bytes' has no description: add it to DESCRIPTIONS in "
                    "scripts/columns_doc.py")


def test_the_site_builds_without_a_warning(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs not installed (pip install -e '.[docs]')")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
