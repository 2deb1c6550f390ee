"""The package reads in the order of the flow: each folder imports only the folders before it, models/ holds models
only, and no import circle exists between modules, imports inside functions and under TYPE_CHECKING included.

Run: pytest tests/test_layers.py (a second; it reads the sources, and imports the folders once).
"""

import ast
from pathlib import Path

FOLDERS = [
    "_errors",
    "_base",
    "_glob",
    "_kept",
    "_version",
    "_faults",
    "_process",
    "_quiet",
    "sharding",
    "config",
    "data",
    "models",
    "parallel",
    "hf",
    "training",
    "estimate",
    "cli",
]
"""shardlab's folders (and its private foundation modules: errors, structs, globs, kept answers, the version, fault points, processes, quiet imports) in the order of the flow."""
TOP = {"__init__", "__main__"}
"""The public API and `python -m shardlab`: they may import anything."""
PACKAGE = Path(__file__).resolve().parents[1] / "shardlab"


def module_name(path: Path) -> str:
    """`estimate/probe.py` -> estimate.probe; a package's `__init__.py` is the package (`estimate`)."""
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__") if name != "__init__" else name


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: Path, typing: bool = True) -> set[str]:
    """The shardlab modules `path` imports, wherever the import sits (`from shardlab.x import y` is module x.y
    where that is a module, else x); typing=False leaves out those under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text())
    hidden = set()
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                hidden |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardlab":
            base = node.module.removeprefix("shardlab").removeprefix(".")
            for a in node.names:
                full = f"{base}.{a.name}" if base else a.name
                names.add(full if full in MODULES else base or "__init__")
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("shardlab.") for a in node.names if a.name.startswith("shardlab.")}
            names |= {"__init__" for a in node.names if a.name == "shardlab"}
    return names


def folder(module: str) -> str:
    return module.split(".")[0]


GRAPH = {name: imported(path) for name, path in MODULES.items()}
RUNTIME = {name: imported(path, typing=False) for name, path in MODULES.items()}
"""What runs: a type named only for annotations (a Plan for the code that prints it) is no circle."""


def test_every_module_is_in_a_folder_of_the_flow():
    stray = sorted(m for m in MODULES if m not in TOP and folder(m) not in FOLDERS)
    assert not stray, f"modules outside the flow's folders: {stray}"


def test_each_folder_imports_only_the_folders_before_it():
    wrong = [
        f"{m} imports {dep}"
        for m, deps in GRAPH.items()
        if m not in TOP
        for dep in deps
        if dep in TOP or FOLDERS.index(folder(dep)) > FOLDERS.index(folder(m))
    ]
    assert not wrong, "\n".join(wrong)


def test_models_import_nothing_that_runs_a_layout():
    wrong = [f"{m} imports {d}" for m, deps in GRAPH.items() if folder(m) == "models" for d in deps
             if folder(d) in ("parallel", "training")]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    """Depth-first search for a back edge among the imports that run, at import or inside functions; the message
    names the whole circle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(RUNTIME.get(m, ())):
            if state.get(dep) == 1:
                circle = path[path.index(dep) :] + [dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(RUNTIME):
        if m not in state:
            visit(m)


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from shardlab.training.step import make_step\n    import shardlab.sharding.plan\n")
    assert imported(source) == {"training.step", "sharding.plan"}


def test_the_circle_check_leaves_out_annotations_only(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardlab.sharding.plan import Plan\n"
    )
    assert imported(source) == {"sharding.plan"} and imported(source, typing=False) == set()


def test_no_public_name_hides_a_folder():
    """`shardlab.training.checkpoint` is the module wherever it is reached from: no name of the public API (the
    function `shardlab.train`, say) shadows a folder's package on `shardlab`."""
    import importlib
    import sys

    import shardlab

    for name in FOLDERS:
        if not name.startswith("_"):
            importlib.import_module(f"shardlab.{name}")
            assert getattr(shardlab, name) is sys.modules[f"shardlab.{name}"], name
