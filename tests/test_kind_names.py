"""Kinds carry their own knowledge (issue 25): outside engine/parallel/dp/ no dp-mode name is compared, and outside
the schedule code (engine/parallel/pp/schedule.py, pp/schedules/, pp/actions.py) no schedule name is; everything
else asks the kind's spec (DpModeSpec, ScheduleSpec). Read from the source like tests/test_layout.py (no imports of
the files checked).

A comparison is a literal name (or a tuple, list or set holding one) on either side of ==, !=, in or not in, the
argument of startswith/endswith, or a key of a dict literal looked up on the spot ({"zero": ...}[mode] or .get).
Scanned: engine/ and the launchers launch/*.py (launch/bench/ names its own table rows, "zero1" and the like)."""
from __future__ import annotations

import ast
from pathlib import Path

from engine.parallel.dp import MODES
from engine.parallel.pp.schedule import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
KINDS = {  # kind -> (its names, the paths (prefixes) where they may be compared)
    "dp mode": (set(MODES), ("engine/parallel/dp/",)),
    "schedule": (set(SCHEDULES), ("engine/parallel/pp/schedule", "engine/parallel/pp/actions.py")),
}


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_literals, node.elts)) if node.elts else set()
    return set()


def _compared(node: ast.AST) -> set[str]:
    """The string literals ``node`` compares something against (module docstring), else nothing."""
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                             for op in node.ops):
        return set().union(*map(_literals, [node.left, *node.comparators]))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("startswith", "endswith"):
            return set().union(set(), *map(_literals, node.args))
        if node.func.attr == "get" and isinstance(node.func.value, ast.Dict):
            return set().union(set(), *(_literals(k) for k in node.func.value.keys if k is not None))
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return set().union(set(), *(_literals(k) for k in node.value.keys if k is not None))
    return set()


def name_comparisons(source: str, names: set[str]) -> list[str]:
    """'line: names' of every comparison of one of ``names`` in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if hits := _compared(node) & names:
            out.append(f"{node.lineno}: {', '.join(sorted(hits))}")
    return sorted(out, key=lambda s: int(s.split(":")[0]))


def test_finder_sees_comparisons():
    names = {"zero", "interleaved"}
    bad = ['p.dp_mode == "zero"', 'mode != "zero"', 'x in ("fsdp", "zero")', 'mode.startswith("zero")',
           '{"interleaved": 2}.get(s, 1)', '{"zero": 1}[mode]', '("interleaved", 1) != (s, v)']
    assert [name_comparisons(line, names) != [] for line in bad] == [True] * len(bad)
    good = ['MODES = {"zero": spec}', 'f(schedule="interleaved")', 'p.offload == "optimizer"', 'names = ["zero"]',
            'SCHEDULES[p.schedule].chunks']
    assert [name_comparisons(line, names) for line in good] == [[]] * len(good)


def test_kind_names_are_compared_only_in_their_packages():
    files = sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "launch").glob("*.py")])
    assert len(files) > 50, "no sources found"
    bad = {}
    for kind, (names, homes) in KINDS.items():
        assert names, f"no {kind} registered"
        for path in files:
            rel = str(path.relative_to(ROOT))
            if not rel.startswith(homes) and (found := name_comparisons(path.read_text(encoding="utf-8"), names)):
                bad[f"{kind} in {rel}"] = found
    assert bad == {}, "ask the kind's spec (engine/parallel/dp/registry.py, engine/parallel/pp/actions.py ScheduleSpec)"


def test_config_checks_read_the_registries_without_torch():
    """The config checks read every registry (dp modes, schedules, recompute modes, model families) before torch
    is loaded, so a bad config fails fast (launch/preflight.py loads one on a login node)."""
    import os
    import subprocess
    import sys
    code = ("import sys\nfrom engine.config import load\nload(['--parallel.dp_mode', 'zero', '--parallel.zero_stage', "
            "'1', '--parallel.schedule', 'gpipe', '--train.activation_checkpointing', 'selective', '--model.family', "
            "'qwen2', '--model.attention_bias', 'true'])\nprint(sorted(m for m in ('torch', 'deepspeed') if m in "
            "sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
