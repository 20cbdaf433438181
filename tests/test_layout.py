"""The architecture rules of docs/architecture.md, read from the source (no imports, no processes; well under a
second): no import circle among engine modules, no engine function over 60 lines (a file is one concept, whatever
its length), every engine file in the docs' file list, the library never imports the launchers or the tests (a
harness inside the library is what issue 13 took out of it), and nothing but engine/parallel/layout/mesh.py indexes
the rank mesh by position (issue 25: axes are asked for by name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The longest engine function was 51 lines when the cap moved from files to functions (issue 36): apply_tensor_parallel
# and config_types.coerce. Counted from the def line to the last line of the body, docstring included.
MAX_FUNCTION_LINES = 60
DOCS = ROOT / "docs" / "architecture.md"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "engine").rglob("*.py"))}


def _type_checking(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements that run when the module is imported: the body, and the branches of module-level if/try
    blocks, but not ``if TYPE_CHECKING:`` and not function or class bodies (a deferred import cannot close a
    circle at import time)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)) and not _type_checking(node):
            for field in ("body", "orelse", "finalbody"):
                todo.extend(getattr(node, field, []))
            todo.extend(s for h in getattr(node, "handlers", []) for s in h.body)
    return found


def imported_names(node: ast.stmt, current: str, is_package: bool) -> list[str]:
    """Dotted names a statement imports; ``from a import b`` gives ``a.b`` (a submodule if there is one) and ``a``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = current.split(".") if is_package else current.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """engine module -> the engine modules it imports at module level."""
    modules = engine_modules(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets = set()
        for node in module_level_imports(tree):
            for dotted in imported_names(node, name, path.name == "__init__.py"):
                if dotted in modules and dotted != name:
                    targets.add(dotted)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: every import circle."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_engine_modules():
    graph = import_graph()
    assert "engine.trainer" in graph and graph["engine.trainer"], "the graph is empty: the parser found nothing"
    assert cycles(graph) == [], "import circles among engine modules (module-level imports)"


def long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """name:line -> length of every function or method (nested ones too) longer than ``limit`` lines."""
    return {
        f"{node.name}:{node.lineno}": n
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > limit
    }


def test_long_function_finder_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == {"f:1": 61}
    assert long_functions(ast.parse(f"def f():\n{body}\n"), limit=61) == {}


def test_no_engine_function_over_60_lines():
    long = {
        f"{p.relative_to(ROOT)}:{name}": n
        for p in engine_modules().values()
        for name, n in long_functions(ast.parse(p.read_text(encoding="utf-8"))).items()
    }
    assert long == {}, f"engine functions over {MAX_FUNCTION_LINES} lines (split by step; a file may be any length)"


def listed_files(text: str) -> set[str]:
    """The engine files docs/architecture.md's file list names: a line of a code block that starts with a path."""
    return set(re.findall(r"^(engine/\S+\.py)\s", text, flags=re.MULTILINE))


def needs_a_line(path: Path) -> bool:
    """Every engine file but a package's __init__.py that holds only its docstring (the package's files have
    their lines)."""
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return not all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def test_every_engine_file_is_in_the_docs_file_list():
    listed = listed_files(DOCS.read_text(encoding="utf-8"))
    every = {str(p.relative_to(ROOT)) for p in engine_modules().values()}
    assert sorted({f for f in every if needs_a_line(ROOT / f)} - listed) == [], (
        "engine files missing from docs/architecture.md's file list"
    )
    assert sorted(listed - every) == [], "docs/architecture.md lists files that do not exist"


def test_engine_imports_neither_launch_nor_tests():
    bad = []
    for name, path in engine_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # every import, deferred ones too
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for dotted in imported_names(node, name, path.name == "__init__.py"):
                    if dotted.split(".")[0] in ("launch", "tests"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {dotted}")
    assert bad == []


MESH_MODULE = "engine/parallel/layout/mesh.py"
# Positional use of the rank mesh: DeviceMesh's rank tensor (mesh.mesh), a mesh subscripted by an index or slice,
# a mesh dimension asked for by number (get_group(0), get_local_rank(1), size(2) on a mesh).
POSITIONAL_MESH = re.compile(r"\bmesh\.mesh\b|\bmesh\[\s*[-\d:(]|\bmesh\.(get_group|get_local_rank|size)\(\s*\d")


def positional_mesh_uses(text: str) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if POSITIONAL_MESH.search(line)]


def test_positional_mesh_finder_sees_positions():
    bad = ["grid = ctx.mesh.mesh", "self.mesh[:, d, :]", "ctx.mesh[0]", "mesh.get_group(0)", "ctx.mesh.size(1)"]
    assert [positional_mesh_uses(line) != [] for line in bad] == [True] * len(bad)
    good = ['ctx.mesh["dp"]', "ctx.group('tp')", "mesh.get_group(name)", "tile_grid[i, j]", "ctx.mesh.size()"]
    assert [positional_mesh_uses(line) for line in good] == [[]] * len(good)


def test_no_positional_mesh_indexing_outside_the_mesh_module():
    files = sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "launch").rglob("*.py")])
    assert files, "no sources found"
    bad = {
        str(p.relative_to(ROOT)): found
        for p in files
        if str(p.relative_to(ROOT)) != MESH_MODULE and (found := positional_mesh_uses(p.read_text(encoding="utf-8")))
    }
    assert bad == {}, "index the mesh by axis name (ctx.group, ctx.axis_rank, ctx.ranks_along: layout/mesh.py)"
