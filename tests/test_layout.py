"""The architecture rules of docs/architecture.md, read from the source (no imports, no processes; well under a
second): the floors (no import points up a floor, every import counted: deferred ones and "engine.a.b:name" strings
too), no import circle among engine modules, the "never" rules (kinds and the config floor torch-free, model never
imports parallel, parallel never the planner, checkpoints, data or HF, the planner never the trainer), no engine
function over 60 lines (a file is one concept, whatever its length), every engine file in the docs' file list, the
library never imports the launchers or the tests (a harness inside the library is what issue 13 took out of it), and
nothing but engine/parallel/layout/mesh.py indexes the rank mesh by position (issue 25: axes are asked for by name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.cli import ROOT

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


def _skipped(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks: annotations only, never run."""
    return {id(n) for node in ast.walk(tree) if _type_checking(node) for n in ast.walk(node)}


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


# A string naming engine code, "engine.a.b:name" or "engine.a.b": what importlib imports when
# the string is used, so it is an import like any other.
ENGINE_PATH = re.compile(r"^(engine(?:\.\w+)+)(?::\w*)?$")


def imports_of(tree: ast.Module, current: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import a module makes: at module level, inside functions (a deferred import runs
    too, and closes a circle as surely), and every engine path string (importlib-named); not under TYPE_CHECKING."""
    skip, found = _skipped(tree), []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [(node.lineno, d) for d in imported_names(node, current, is_package)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := ENGINE_PATH.match(node.value)):
            found.append((node.lineno, m.group(1)))
    return found


def import_edges(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """engine module -> {engine module it imports: the first line that does}, every import counted (imports_of)."""
    modules = engine_modules(root)
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets: dict[str, int] = {}
        for line, dotted in sorted(imports_of(tree, name, path.name == "__init__.py")):
            if dotted in modules and dotted != name:
                targets.setdefault(dotted, line)
        edges[name] = targets
    return edges


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """engine module -> the engine modules it imports (every import: imports_of)."""
    return {name: set(targets) for name, targets in import_edges(root).items()}


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
    assert cycles(graph) == [], "import circles among engine modules (deferred and importlib-named imports counted)"


# The floors of docs/architecture.md, bottom first: a module imports only its own floor and those below (an upward
# arrow fails test_no_upward_import). A name is a module or a package (every module under it); "engine" is the package
# module alone. tests/test_layout.py reads the docs' drawing and checks that it says the same.
FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "engine",
        "engine.errors",
        "engine.json_input",
        "engine.storage",
        "engine.internals",
        "engine.kinds",
        "engine.assets",
        "engine.trust.oplog",
    ),
    ("engine.config_types", "engine.config_yaml", "engine.config", "engine.config_checks"),
    ("engine.model", "engine.metrics", "engine.cluster", "engine.optim"),
    ("engine.parallel",),
    ("engine.data", "engine.checkpoint", "engine.trust"),
    ("engine.planning",),
    ("engine.hf", "engine.stage", "engine.trainer"),
)
# Upward imports the docs justify, (importer, imported) -> why. None today.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def floor_of(module: str, floors: tuple[tuple[str, ...], ...] = FLOORS) -> int | None:
    """The floor of the longest name in ``floors`` that is ``module`` or a package holding it."""
    best, floor = "", None
    for n, names in enumerate(floors):
        for name in names:
            holds = module == name or (name != "engine" and module.startswith(name + "."))
            if holds and len(name) > len(best):
                best, floor = name, n
    return floor


def test_floor_of_takes_the_longest_name():
    floors = (("engine", "engine.kinds"), ("engine.model",), ("engine.model.hf",))
    assert [floor_of(m, floors) for m in ("engine", "engine.kinds.x", "engine.model.a", "engine.model.hf.b")] == [
        0,
        0,
        1,
        2,
    ]
    assert floor_of("engine.other", floors) is None  # "engine" is the package module alone


def test_every_engine_module_is_on_a_floor():
    assert [m for m in engine_modules() if floor_of(m) is None] == [], "add the module's package to FLOORS"


def upward_imports(edges: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)}), line {line}"
        for a, targets in sorted(edges.items())
        for b, line in sorted(targets.items())
        if (floor_of(b) or 0) > (floor_of(a) or 0) and (a, b) not in UPWARD_EXCEPTIONS
    ]


def test_no_upward_import():
    assert upward_imports(import_edges()) == [], "imports pointing up a floor (FLOORS, docs/architecture.md)"


def test_floors_are_the_docs_drawing():
    """docs/architecture.md draws the floors as a table | n | names |, bottom first: the same as FLOORS."""
    text = DOCS.read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d) \| (.+?) \|$", text, flags=re.MULTILINE)
    drawn = [tuple(re.findall(r"`(engine[\w.]*)`", names)) for _, names in rows]
    assert [int(n) for n, _ in rows] == list(range(len(FLOORS))) and tuple(drawn) == FLOORS


def imports_between(importer: str, imported: tuple[str, ...]) -> list[str]:
    """Every import by a module under ``importer`` of a module under one of ``imported`` (every import counted)."""
    under = lambda m, names: any(m == n or m.startswith(n + ".") for n in names)  # noqa: E731
    return [
        f"{a} -> {b}, line {line}"
        for a, targets in sorted(import_edges().items())
        if under(a, (importer,))
        for b, line in sorted(targets.items())
        if under(b, imported)
    ]


def torch_imports(modules: list[str]) -> list[str]:
    paths = engine_modules()
    return [
        f"{m}:{line} imports {dotted}"
        for m in modules
        for line, dotted in imports_of(ast.parse(paths[m].read_text(encoding="utf-8")), m, False)
        if dotted.split(".")[0] in ("torch", "numpy", "deepspeed", "transformers", "safetensors")
    ]


def test_kinds_import_nothing_above_errors_and_no_torch():
    kinds = [m for m in engine_modules() if m.startswith("engine.kinds")]
    above = [
        line
        for line in imports_between("engine.kinds", ("engine",))
        if not line.split(" -> ")[1].startswith(("engine.kinds", "engine.errors", "engine.json_input"))
    ]
    assert above == [], "engine/kinds/ is the bottom floor: it imports engine.errors, engine.json_input and itself only"
    assert torch_imports(kinds) == [], "engine/kinds/ imports no torch: a config is read before torch"


def reachable(graph: dict[str, set[str]], start: list[str]) -> list[str]:
    seen, todo = set(start), list(start)
    while todo:
        todo += [w for w in graph.get(todo.pop(), ()) if w not in seen and not seen.add(w)]
    return sorted(seen)


def test_the_config_floor_imports_no_torch():
    """Loading and validating a config imports no torch, at module level or deferred, nor does anything it imports:
    launch/pretrain.py refuses a bad config before torch is imported."""
    config = [m for m in engine_modules() if floor_of(m) == 1]
    assert torch_imports(reachable(import_graph(), config)) == []


def test_model_never_imports_parallel():
    assert imports_between("engine.model", ("engine.parallel",)) == [], (
        "the model is plain nn.Modules: engine/parallel/ applies itself to it (stage.py), never the other way"
    )


def test_parallel_never_imports_planning_checkpoint_data_or_hf():
    bad = imports_between("engine.parallel", ("engine.planning", "engine.checkpoint", "engine.data", "engine.hf"))
    assert bad == [], "engine/parallel/ runs the axes; the planner, checkpoints, data and HF interop read it"


def test_planning_never_imports_trainer_or_stage():
    assert imports_between("engine.planning", ("engine.trainer", "engine.stage")) == [], (
        "the planner prices a layout without building one"
    )


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


def test_no_test_module_imports_another():
    """Shared test pieces live in helper modules (tests/cluster/jobs.py, tests/cli.py, ...), never in a test module
    another test file imports (issue 36): a test file is read alone."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = imported_names(node, "tests", False) if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[-1].startswith("test_")
            ]
    assert bad == [], "move what several test files share into a helper module"
