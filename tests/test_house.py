"""The house rules of issue #53 that the import-linter contracts (tests/test_layers.py) do not cover: no import
cycles among mistjax's modules, no function over 80 lines, no new class over 400 lines, nothing binary tracked."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400
# Classes over the limit when the rule was written (issue #53: restructured by the executor rework, not here).
# The list may only shrink: a new long class fails, and so does a listed one that is no longer long (drop it).
LONG_CLASSES = frozenset({
    "mistjax/analysis/tp.py:Propagator",  # 476 lines on 2026-12-07
})
BINARY_SUFFIXES = (".whl", ".so", ".pyc", ".zip", ".tar.gz", ".tgz", ".egg", ".npz", ".npy", ".pkl")


def _definitions() -> list[tuple[str, ast.AST, int]]:
    """(``path:name``, node, lines) of every function and class in mistjax/, nested ones included."""
    out = []
    for path in sorted((ROOT / "mistjax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.append((f"{rel}:{node.name}", node, node.end_lineno - node.lineno + 1))
    return out


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(imports.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    u = stack.pop()
                    on_stack.discard(u)
                    comp.append(u)
                    if u == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a two-module cycle and a three-module one are found, a chain is not."""
    found = _cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "x": {"y"}, "y": set()})
    assert sorted(found) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_cycles_in_mistjax():
    """Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too (grimp's graph, as
    import-linter builds it): a module pair that needs each other shares a piece that belongs lower down."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("mistjax", cache_dir=None)
    imports = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = _cycles(imports)
    assert not cycles, "import cycles among mistjax modules (move the shared pieces to a module both import): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


def test_no_function_over_80_lines():
    long = [f"{name} ({n} lines)" for name, node, n in _definitions()
            if not isinstance(node, ast.ClassDef) and n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {', '.join(long)}"


def test_no_new_class_over_400_lines():
    long = {name: n for name, node, n in _definitions() if isinstance(node, ast.ClassDef) and n > MAX_CLASS_LINES}
    new = [f"{name} ({n} lines)" for name, n in long.items() if name not in LONG_CLASSES]
    assert not new, f"classes over {MAX_CLASS_LINES} lines (split them): {', '.join(new)}"
    short = sorted(LONG_CLASSES - set(long))
    assert not short, f"no longer over {MAX_CLASS_LINES} lines: drop them from LONG_CLASSES: {short}"


def test_nothing_binary_is_tracked():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    binary = [p for p in tracked.splitlines() if p.endswith(BINARY_SUFFIXES)]
    assert not binary, f"binary or generated files are tracked (git rm them; .gitignore them): {binary}"
    ignored = subprocess.run(["git", "check-ignore", "-q", "some_tool-1.0-py3-none-any.whl"], cwd=ROOT)
    assert ignored.returncode == 0, ".gitignore must cover *.whl"
