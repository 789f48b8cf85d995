"""The package's imports run one way: down the layers below, never back up, with no circle of modules or of
folders; imports inside functions are few and each says why; a module that others import names its public
surface (`__all__`) and gives them nothing private. Read from the source (ast), so every import counts, wherever
it stands."""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "vlmprobe"
# Top to bottom. A module may import modules of its own folder (without a circle) and of any layer below its
# own; two folders of one layer do not import each other. docs/architecture.md draws the same layers.
LAYERS = [
    ["vlmprobe.__main__"],
    ["vlmprobe.web"],  # vlmprobe serve: the web page, through vlmprobe.api
    ["vlmprobe.cli", "vlmprobe.api"],  # the command line; the same from Python
    ["vlmprobe.run"],  # the sweep's side of the process boundary
    ["vlmprobe.config"],  # what a point is, validated
    ["vlmprobe.point"],  # a point's side of the process boundary
    ["vlmprobe.backends", "vlmprobe.distributed", "vlmprobe.knobs"],
    ["vlmprobe.estimate", "vlmprobe.steps", "vlmprobe.quantization", "vlmprobe.kernels", "vlmprobe.results",
     "vlmprobe.dataset"],
    ["vlmprobe.gpu", "vlmprobe.models", "vlmprobe.optimizers"],
    ["vlmprobe.sizes", "vlmprobe.script_args", "vlmprobe.recipes"],
    ["vlmprobe", "vlmprobe.errors", "vlmprobe.paths", "vlmprobe.states", "vlmprobe.child", "vlmprobe.interrupt",
     "vlmprobe.hub"],
]
MAX_IMPORTS_IN_FUNCTIONS = 15


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a name imported from a module is that module)
    names: tuple[str, ...]  # the names taken from it (empty: the module itself)
    in_function: bool
    line: int
    commented: bool  # a comment on its line or on the line above it


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def read_imports() -> list[Import]:
    found = []
    for source, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        in_functions = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for node in ast.walk(fn)}
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                pairs = [(f"{base}.{a.name}", ()) if f"{base}.{a.name}" in MODULES else (base, (a.name,))
                         for a in node.names]
            else:
                continue
            line = node.lineno
            commented = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
            for target, names in pairs:
                if target.split(".")[0] != "vlmprobe":
                    continue
                while target not in MODULES:
                    target = target.rpartition(".")[0]
                found.append(Import(source, target, names, id(node) in in_functions, line, commented))
    return found


IMPORTS = read_imports()


def layer_of(module: str) -> tuple[int, str]:
    """(the layer's index, the layer entry the module belongs to)."""
    for index, entries in enumerate(LAYERS):  # the longest entry that holds it (vlmprobe.run before vlmprobe)
        for entry in entries:
            if module == entry or (module.startswith(entry + ".") and entry != "vlmprobe"):
                return index, entry
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def folder_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan), each a circle of imports."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], itertools.count()

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_run_down_the_layers():
    upward = []
    for imp in IMPORTS:
        (mine, my_entry), (theirs, their_entry) = layer_of(imp.source), layer_of(imp.target)
        if my_entry == their_entry:
            continue  # within one folder: the circle test below
        if theirs <= mine:
            upward.append(f"{imp.source}:{imp.line} imports {imp.target} (layer {mine} -> {theirs})")
    assert not upward, "imports that do not run down the layers:\n" + "\n".join(upward)


def test_no_module_imports_itself_through_others():
    edges = {(imp.source, imp.target) for imp in IMPORTS if imp.source != imp.target}
    assert not cycles(edges), f"import circles: {cycles(edges)}"


def test_no_folder_imports_itself_through_others():
    edges = {(folder_of(imp.source), folder_of(imp.target)) for imp in IMPORTS
             if folder_of(imp.source) != folder_of(imp.target)
             and not folder_of(imp.target).startswith(folder_of(imp.source) + ".")}  # a folder uses its sub-folders
    assert not cycles(edges), f"folder circles: {cycles(edges)}"


def test_imports_inside_functions_are_few_and_each_says_why():
    inside = [imp for imp in IMPORTS if imp.in_function]
    assert len(inside) <= MAX_IMPORTS_IN_FUNCTIONS, [f"{i.source}:{i.line}" for i in inside]
    silent = [f"{i.source}:{i.line} -> {i.target}" for i in inside if not i.commented]
    assert not silent, "imports inside functions without a comment that says why:\n" + "\n".join(silent)


@pytest.mark.parametrize("module", sorted({imp.target for imp in IMPORTS if imp.names}))
def test_a_module_others_import_from_names_what_it_gives(module):
    """Every name another module takes from it is in its __all__ (or is one of its sub-modules), and none is
    private."""
    tree = ast.parse(MODULES[module].read_text())
    declared = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)), None)
    assert declared is not None, f"{module} is imported from elsewhere but has no __all__"
    taken = {(name, imp.source) for imp in IMPORTS if imp.target == module and imp.source != module
             for name in imp.names if f"{module}.{name}" not in MODULES}
    private = sorted(f"{source} takes {name}" for name, source in taken if name.startswith("_"))
    assert not private, f"private names of {module} used elsewhere: {private}"
    missing = sorted(f"{source} takes {name}" for name, source in taken if name not in declared)
    assert not missing, f"names of {module} used elsewhere but not in its __all__: {missing}"
