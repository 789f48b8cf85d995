"""A dataset's samples as shapes: each sample's text tokens, image sizes (height, width) and video sizes (frames,
height, width), read from a file on local disk.

Formats (the first record's keys decide; `read_samples` says which it read):
- shapes: JSONL, JSON, CSV or parquet with `text_tokens` (int), `images` ([[height, width], ...] px) and optional
  `videos` ([[frames, height, width], ...]); in CSV the lists are JSON text.
- LLaMA-Factory alpaca (instruction / input / output / system / history) and sharegpt (`conversations` of
  {from, value}), with an `images` column of paths (LLaMA-Factory data/README.md; its dataset_info.json `columns`
  and `tags` are honoured when the source is that dataset_info.json and `dataset` names the entry). Relative image
  paths are joined to the media folder (image_dir; else the dataset_info.json's folder, LLaMA-Factory's
  media_dir default; else the data file's folder) where that file exists.
- ms-swift's and TRL's `messages` ({role, content}; content a string with <image> tags, or TRL's list of
  {"type": "text" | "image", ...} parts) with an `images` column (paths, or {path, bytes} records).
- a folder written by `datasets`' save_to_disk: its state.json lists Arrow stream files, read with pyarrow
  (`datasets` itself is not needed); the records are then any of the formats above.
Videos are read from shapes files only: a video file's frame count needs a container decoder vlmprobe does not
bring. Text tokens come from a tokenizer or the stated estimate (vlmprobe/dataset/text.py).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlmprobe.dataset.images import image_size
from vlmprobe.dataset.synthetic import SYNTHETIC_PREFIX, synthetic_samples
from vlmprobe.dataset.text import TextCounter
from vlmprobe.dataset.shapes import Sample
from vlmprobe.errors import ConfigError, whole

__all__ = ["FORMATS", "read_samples", "Sample", "sample_notes"]

FORMATS = ("shapes", "alpaca", "sharegpt", "messages")
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow")
READABLE = (f"a shapes / LLaMA-Factory alpaca or sharegpt / messages file ({', '.join(SUFFIXES)}), a "
            f"LLaMA-Factory dataset_info.json with dataset=NAME, a save_to_disk folder, or synthetic:{{...}}")
# LLaMA-Factory's defaults for a dataset_info.json entry's columns and sharegpt tags (data/README.md)
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                  "history": "history", "images": "images", "videos": "videos"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools", "images": "images",
                    "videos": "videos"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value"}


def read_samples(source, *, image_dir: str | Path | None = None, tokenizer=None, dataset: str | None = None,
                 cache_dir: str | Path | None = None) -> list[Sample]:
    """The samples of `source`: a path (see the module docstring), `synthetic:{json}` or a synthetic config dict
    (vlmprobe/dataset/synthetic.py). ConfigError (one line) for a source it cannot read, an empty dataset, a
    sample without length information, a missing or unreadable image."""
    if isinstance(source, dict) or (isinstance(source, str) and source.startswith(SYNTHETIC_PREFIX)):
        samples = synthetic_samples(source)
    else:
        samples = read_path(Path(source), image_dir, TextCounter(tokenizer, cache_dir), dataset)
    if not samples:
        raise ConfigError(f"dataset {source!r} is not allowed: it holds no samples")
    return samples


def sample_notes(samples: list[Sample]) -> list[str]:
    """One line per way the samples' text tokens were found (a tokenizer, the file, the estimate), with counts."""
    counts: dict[str, int] = {}
    for sample in samples:
        counts[sample.text_from] = counts.get(sample.text_from, 0) + 1
    return [f"text tokens of {n} sample(s): {how}" for how, n in counts.items()]


def read_path(path: Path, image_dir, counter: TextCounter, dataset: str | None) -> list[Sample]:
    folder = Path(image_dir) if image_dir is not None else None
    if path.is_dir():
        if (path / "state.json").is_file():
            return from_records(saved_records(path), folder or path, counter, str(path))
        if (path / "dataset_info.json").is_file():
            path = path / "dataset_info.json"
        else:
            raise ConfigError(f"dataset {str(path)!r} is not allowed: a folder must be a save_to_disk folder "
                              f"(state.json) or hold a LLaMA-Factory dataset_info.json; readable: {READABLE}")
    if not path.is_file():
        raise ConfigError(f"dataset {str(path)!r} is not allowed: no such file or folder")
    if path.name == "dataset_info.json":
        return from_registry(path, folder, counter, dataset)
    return from_records(file_records(path), folder or path.parent, counter, str(path))


def from_registry(path: Path, folder: Path | None, counter: TextCounter, dataset: str | None) -> list[Sample]:
    """A LLaMA-Factory dataset_info.json entry: its file, formatting, columns and tags."""
    try:
        registry = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dataset {str(path)!r} is not allowed: it cannot be read as JSON ({exc})") from None
    if dataset not in registry:
        raise ConfigError(f"dataset={dataset!r} is not allowed with {path}: name one of its entries: "
                          f"{', '.join(sorted(registry)) or '(none)'}")
    entry = registry[dataset]
    if "file_name" not in entry:
        raise ConfigError(f"dataset={dataset!r} is not allowed: its entry in {path} has no file_name (only local "
                          f"files are read; hub and script entries are not)")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(f"dataset={dataset!r} is not allowed: formatting={formatting!r}; LLaMA-Factory's are "
                          f"alpaca and sharegpt")
    data = path.parent / entry["file_name"]
    records = saved_records(data) if (data / "state.json").is_file() else file_records(data)
    columns = {**(ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS), **entry.get("columns", {})}
    tags = {**SHAREGPT_TAGS, **entry.get("tags", {})}
    where = folder or path.parent  # LLaMA-Factory's media_dir defaults to its dataset_dir
    return [sample_of(record, i, formatting, columns, tags, where, counter) for i, record in enumerate(records)]


def from_records(records: list[dict], folder: Path, counter: TextCounter, name: str) -> list[Sample]:
    if not records:
        raise ConfigError(f"dataset {name!r} is not allowed: it holds no samples")
    kind = format_of(records[0], name)
    columns = ALPACA_COLUMNS if kind == "alpaca" else SHAREGPT_COLUMNS
    if kind == "messages":
        columns = {**SHAREGPT_COLUMNS, "messages": "messages"}
    return [sample_of(record, i, kind, columns, SHAREGPT_TAGS, folder, counter) for i, record in enumerate(records)]


def format_of(record: dict, name: str) -> str:
    if not isinstance(record, dict):
        raise ConfigError(f"dataset {name!r} is not allowed: its records are not objects; readable: {READABLE}")
    for key, kind in (("text_tokens", "shapes"), ("conversations", "sharegpt"), ("messages", "messages"),
                      ("instruction", "alpaca")):
        if key in record:
            return kind
    raise ConfigError(f"dataset {name!r} is not allowed: its records' keys {sorted(record)} match no format; "
                      f"formats: shapes (text_tokens, images), alpaca (instruction), sharegpt (conversations), "
                      f"messages (messages)")


# -- records from files ---------------------------------------------------------------------------------------
def file_records(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"dataset {str(path)!r} is not allowed: {suffix or 'no suffix'} is not a format it reads; "
                          f"readable: {READABLE}")
    try:
        if suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        if suffix == ".arrow":
            return arrow_records(path)
        text = path.read_text()
        if suffix == ".csv":
            return [{k: csv_value(v) for k, v in row.items()} for row in csv.DictReader(text.splitlines())]
        if suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError(f"dataset {str(path)!r} is not allowed: it cannot be read as {suffix[1:]} "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def csv_value(text: str | None):
    """A CSV cell: JSON where it parses as a list or a number (the shapes format's lists are JSON text), else text."""
    if text is None:
        return None
    stripped = text.strip()
    if stripped[:1] in "[{" or stripped.lstrip("-").isdigit():
        try:
            return json.loads(stripped)
        except ValueError:
            return text
    return text


def arrow_records(path: Path) -> list[dict]:
    """An Arrow file as `datasets` writes it (the IPC stream format), or the IPC file format."""
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all().to_pylist()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all().to_pylist()


def saved_records(folder: Path) -> list[dict]:
    """The records of a `datasets` save_to_disk folder: state.json's `_data_files`, in order."""
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"dataset {str(folder)!r} is not allowed: its state.json does not list its data files "
                          f"as save_to_disk writes them ({exc})") from None
    records = []
    for file in files:
        try:
            records += arrow_records(file)
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"dataset {str(folder)!r} is not allowed: {file.name} cannot be read as Arrow "
                              f"({exc})") from None
    return records


# -- one record -----------------------------------------------------------------------------------------------
def sample_of(record: dict, index: int, kind: str, columns: dict, tags: dict, folder: Path,
              counter: TextCounter) -> Sample:
    where = f"sample {index}"
    if kind == "shapes":
        return shapes_sample(record, index, where)
    if record.get(columns.get("videos")):
        raise ConfigError(f"{where}: videos={record[columns['videos']]!r} is not allowed in a {kind} dataset: a video "
                          f"file's frames are not read here; give [frames, height, width] in a shapes file")
    texts = texts_of(record, kind, columns, tags, where)
    references = list(record.get(columns["images"]) or [])
    if not references and kind == "messages":  # TRL: images may sit in the content parts themselves
        references = [part.get("image") or part.get("path") for message in record.get(columns["messages"]) or []
                      if isinstance(message.get("content"), list) for part in message["content"]
                      if isinstance(part, dict) and part.get("type") == "image"
                      and (part.get("image") or part.get("path"))]
    if not isinstance(references, list):
        references = [references]
    images = tuple(image_size(ref, folder, where) for ref in references)
    return Sample(index=index, text_tokens=counter.count(texts), images=images, text_from=counter.source)


def texts_of(record: dict, kind: str, columns: dict, tags: dict, where: str) -> list[str]:
    """Every text of a record that the prompt or the answer holds; ConfigError where it has none."""
    texts = []
    for key in ("system", "tools"):
        if isinstance(record.get(columns.get(key)), str):
            texts.append(record[columns[key]])
    if kind == "alpaca":
        found = [record.get(columns[k]) for k in ("prompt", "query", "response")]
        if not any(isinstance(t, str) for t in found):
            raise ConfigError(f"{where} is not allowed: it has no length information (no {columns['prompt']!r}, "
                              f"{columns['query']!r} or {columns['response']!r} text)")
        texts += [t for t in found if isinstance(t, str)]
        for turn in record.get(columns["history"]) or []:
            texts += [t for t in turn if isinstance(t, str)]
        return texts
    messages = record.get(columns["messages"])
    if isinstance(messages, str):  # a JSON column (LLaMA-Factory accepts it)
        try:
            messages = json.loads(messages)
        except ValueError:
            messages = None
    if not messages or not isinstance(messages, list):
        raise ConfigError(f"{where} is not allowed: it has no length information (no {columns['messages']!r} list)")
    content = tags["content_tag"] if kind == "sharegpt" else "content"
    for message in messages:
        value = message.get(content) if isinstance(message, dict) else None
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):  # TRL's content parts
            texts += [part["text"] for part in value if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return texts


def shapes_sample(record: dict, index: int, where: str) -> Sample:
    tokens = record.get("text_tokens")
    if tokens is None:
        raise ConfigError(f"{where} is not allowed: it has no length information (text_tokens is missing)")
    if not whole(tokens) or tokens < 0:
        raise ConfigError(f"{where}: text_tokens={tokens!r} is not allowed: it must be an integer >= 0")
    images = tuple(sized(v, 2, "images", where) for v in listed(record.get("images"), "images", where))
    videos = tuple(sized(v, 3, "videos", where) for v in listed(record.get("videos"), "videos", where))
    return Sample(index=index, text_tokens=tokens, images=images, videos=videos, text_from="given (text_tokens)")


def listed(value, key: str, where: str) -> list:
    if value is None:
        return []
    if isinstance(value, str):  # CSV: JSON text
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{where}: {key}={value!r} is not allowed: give a JSON list") from None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key}={value!r} is not allowed: give a list")
    return value


def sized(value, n: int, key: str, where: str) -> tuple[int, ...]:
    shape = "[height, width]" if n == 2 else "[frames, height, width]"
    if not isinstance(value, (list, tuple)) or len(value) != n or not all(whole(v) and v > 0 for v in value):
        raise ConfigError(f"{where}: {key} entry {value!r} is not allowed: give {shape} as positive integers")
    return tuple(value)
