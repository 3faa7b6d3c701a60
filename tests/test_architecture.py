"""The package's layers stack: no module imports a layer above its own, and no imports form a cycle.

Read from the source's AST (every import, also those inside functions), so nothing is imported to check. The layers
are read from the one place they are written: the ```layers block of ARCHITECTURE.md at the repository root (one
layer per line, bottom first, the folders of a layer on one line; ``#`` starts a comment). Folders of one layer do
not import each other either; ``__init__`` is the package's own ``__init__.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_adaspec"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"


def read_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """The layers of the one ```layers block in ``text`` (markdown), bottom first: per line its folders."""
    blocks = re.findall(r"^```layers[ \t]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    if len(blocks) != 1:
        raise ValueError(f"ARCHITECTURE.md needs exactly one ```layers block, found {len(blocks)}")
    layers = tuple(tuple(line.split("#", 1)[0].split()) for line in blocks[0].splitlines())
    return tuple(layer for layer in layers if layer)


LAYERS = read_layers(ARCHITECTURE.read_text())
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    parts = ("hf_adaspec", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name lives in (a submodule if one exists, else its package); None: outside."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):  # every import, also inside functions
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules) if name.startswith("hf_adaspec") else None
            if target is not None and target != module and (target, node.lineno) not in found:
                found.append((target, node.lineno))
    return found


def _layer(module: str) -> str:
    """The first folder under hf_adaspec (``__init__`` for the package itself, the stem for a top module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, list[tuple[str, int]]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_folder_has_a_layer():
    assert {_layer(m) for m in _modules()} <= set(RANK), "a new folder needs a place in ARCHITECTURE.md's layers"


def test_every_layer_names_a_folder_once():
    names = [part for parts in LAYERS for part in parts]
    assert len(names) == len(set(names)), f"a folder in two layers: {names}"
    assert set(names) <= {_layer(m) for m in _modules()}, "ARCHITECTURE.md's layers name a folder that is gone"


def test_the_layers_block_is_read_bottom_first_without_comments():
    text = "# A\n\n```layers\nfiles config  # the bottom\n\nmodels\n```\n\n```\nnot layers\n```\n"
    assert read_layers(text) == (("files", "config"), ("models",))
    with pytest.raises(ValueError, match="exactly one"):
        read_layers(text + text)


def test_readme_and_the_package_docstring_point_to_architecture_md():
    readme = (ROOT / "README.md").read_text()
    package_doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    assert "ARCHITECTURE.md" in readme and "ARCHITECTURE.md" in package_doc


def _upward(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import from a module to a layer at or above its own (outside its own folder), as text."""
    out = []
    for module, imports in graph.items():
        here = _layer(module)
        for target, line in imports:
            there = _layer(target)
            if there != here and RANK[there] >= RANK[here]:
                out.append(
                    f"{module}:{line} imports {target} ({there}, layer {RANK[there]}) from {here} (layer {RANK[here]})"
                )
    return out


def test_no_module_imports_a_layer_above_its_own():
    upward = _upward(_graph())
    assert not upward, "imports that do not run down the layers:\n" + "\n".join(upward)


def test_an_upward_import_is_reported_with_its_line():
    graph = {
        "hf_adaspec.engine.loop": [("hf_adaspec.policy.goodput", 3), ("hf_adaspec.cli.cli", 9)],
        "hf_adaspec.costs.table": [("hf_adaspec.proposers.base", 4)],
    }
    assert _upward(graph) == [
        "hf_adaspec.engine.loop:9 imports hf_adaspec.cli.cli (cli, layer 11) from engine (layer 5)",
        "hf_adaspec.costs.table:4 imports hf_adaspec.proposers.base (proposers, layer 3) from costs (layer 3)",
    ]


def _cycles(graph: dict[str, list[str]]) -> list[str]:
    """Every import cycle a depth-first walk meets, as "a → b → a"."""
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycles.append(" → ".join([*stack[stack.index(nxt) :], node, nxt] if nxt in stack else [node, nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [])
    return cycles


def test_no_import_cycles():
    cycles = _cycles({m: sorted({t for t, _ in imports}) for m, imports in _graph().items()})
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_a_cycle_is_reported():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a → b → c → a"]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from ..cli import cli\n", "hf_adaspec.cli.cli"),
        ("from ..backend.hf_compat import new_cache\n", "hf_adaspec.backend.hf_compat"),
        ("import hf_adaspec.policy.goodput as g\n", "hf_adaspec.policy.goodput"),
    ],
)
def test_the_import_reader_resolves_relative_and_absolute_imports(tmp_path, source, expected):
    modules = _modules()
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _imports("hf_adaspec.engine.probe", path, modules) == [(expected, 1)]
