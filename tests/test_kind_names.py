"""Kinds carry their own knowledge (issues 25, 36): a kind's name is compared only in its own package; everything
else asks the kind's spec. Every registry is covered, each declared in engine/kinds/: dp modes (DpModeSpec), schedules
(ScheduleSpec), model families (FamilySpec), cp modes (CpModeSpec), recompute modes (RecomputeSpec) and offload
(OffloadSpec). A kind's own package, where alone its names may be compared, is its engine/kinds/ module plus the
package that resolves its names (dp modes: engine/parallel/dp/; schedules: engine/parallel/pp/schedule.py). Read
from the source like tests/test_layout.py (no imports of the files checked).

A comparison is a literal name (or a tuple, list or set holding one) on either side of ==, !=, in or not in, the
argument of startswith/endswith, or a key of a dict literal looked up on the spot ({"zero": ...}[mode] or .get).
A name that is also the value of another config key ("none": grad_compression, rope_scaling, ...) counts only where
the comparison names one of the kind's config keys (``p.offload != "none"``, not ``m.rope_scaling == "none"``).
Scanned: engine/ and the launchers launch/*.py (launch/bench/ names its own table rows, "zero1" and the like)."""

from __future__ import annotations

import ast
import re

from engine.config_checks import CHOICES
from engine.kinds.cp_modes import CP_MODES
from engine.kinds.dp_modes import MODES
from engine.kinds.families import FAMILIES
from engine.kinds.offload import OFFLOADS
from engine.kinds.recompute import RECOMPUTE
from engine.kinds.schedules import SCHEDULES
from tests.cli import ROOT

KINDS = {  # kind -> (its names, the config keys holding one, the paths (prefixes) where they may be compared)
    "dp mode": (
        set(MODES),
        ("dp_mode",),
        ("engine/kinds/dp_modes.py", "engine/kinds/dp_checks.py", "engine/parallel/dp/"),
    ),
    "schedule": (set(SCHEDULES), ("schedule",), ("engine/kinds/schedules.py", "engine/parallel/pp/schedule")),
    "model family": (set(FAMILIES), ("family",), ("engine/kinds/families.py",)),
    "cp mode": (set(CP_MODES), ("cp_mode",), ("engine/kinds/cp_modes.py",)),
    "recompute mode": (set(RECOMPUTE), ("activation_checkpointing", "recompute"), ("engine/kinds/recompute.py",)),
    "offload": (set(OFFLOADS), ("offload",), ("engine/kinds/offload.py",)),
}
# Values of more than one config key: a comparison of one is a kind's only where it names that kind's key
SHARED = {v for v in set().union(*map(set, CHOICES.values())) if sum(v in values for values in CHOICES.values()) > 1}


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_literals, node.elts)) if node.elts else set()
    return set()


def _compared(node: ast.AST) -> set[str]:
    """The string literals ``node`` compares something against (module docstring), else nothing."""
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
        return set().union(*map(_literals, [node.left, *node.comparators]))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("startswith", "endswith"):
            return set().union(set(), *map(_literals, node.args))
        if node.func.attr == "get" and isinstance(node.func.value, ast.Dict):
            return set().union(set(), *(_literals(k) for k in node.func.value.keys if k is not None))
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return set().union(set(), *(_literals(k) for k in node.value.keys if k is not None))
    return set()


def name_comparisons(
    source: str, names: set[str], keys: tuple[str, ...] = (), shared: set[str] = frozenset()
) -> list[str]:
    """'line: names' of every comparison of one of ``names`` in ``source``; one of ``shared`` counts only where the
    comparison mentions one of ``keys`` (module docstring)."""
    out = []
    mentions = re.compile(r"\b(" + "|".join(map(re.escape, keys)) + r")\b") if keys else None
    for node in ast.walk(ast.parse(source)):
        hits = _compared(node) & names
        if hits & shared and not (mentions and mentions.search(ast.unparse(node))):
            hits -= shared
        if hits:
            out.append(f"{node.lineno}: {', '.join(sorted(hits))}")
    return sorted(out, key=lambda s: int(s.split(":")[0]))


def test_finder_sees_comparisons():
    names = {"zero", "interleaved"}
    bad = [
        'p.dp_mode == "zero"',
        'mode != "zero"',
        'x in ("fsdp", "zero")',
        'mode.startswith("zero")',
        '{"interleaved": 2}.get(s, 1)',
        '{"zero": 1}[mode]',
        '("interleaved", 1) != (s, v)',
    ]
    assert [name_comparisons(line, names) != [] for line in bad] == [True] * len(bad)
    good = [
        'MODES = {"zero": spec}',
        'f(schedule="interleaved")',
        'p.offload == "optimizer"',
        'names = ["zero"]',
        "SCHEDULES[p.schedule].chunks",
    ]
    assert [name_comparisons(line, names) for line in good] == [[]] * len(good)


def test_finder_tells_a_shared_value_by_its_key():
    """ "none" is an offload, a recompute mode, a grad compression and a RoPE scaling: it counts where the kind's key
    is compared."""
    names, keys = set(OFFLOADS), ("offload",)
    assert "none" in SHARED and "optimizer" not in SHARED
    bad = [
        'p.offload != "none"',
        '{"none": "", "optimizer": "+off"}[p.offload]',
        'offload == "none"',
        'mode == "optimizer"',
    ]
    assert [name_comparisons(line, names, keys, SHARED) != [] for line in bad] == [True] * len(bad)
    good = [
        'm.rope_scaling == "none"',
        'p.grad_compression != "none"',
        'run_id in ("", "none")',
        "OFFLOADS[p.offload].offloads",
    ]
    assert [name_comparisons(line, names, keys, SHARED) for line in good] == [[]] * len(good)


def test_kind_names_are_compared_only_in_their_packages():
    files = sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "launch").glob("*.py")])
    assert len(files) > 50, "no sources found"
    bad = {}
    for kind, (names, keys, homes) in KINDS.items():
        assert names, f"no {kind} registered"
        for path in files:
            rel = str(path.relative_to(ROOT))
            source = path.read_text(encoding="utf-8")
            if not rel.startswith(homes) and (found := name_comparisons(source, names, keys, SHARED)):
                bad[f"{kind} in {rel}"] = found
    assert bad == {}, (
        "ask the kind's spec (engine/kinds/, engine/kinds/dp_modes.py, engine/parallel/pp/actions.py "
        "ScheduleSpec; docs/recipes.md)"
    )


def test_every_kind_is_a_config_choice_read_from_its_registry():
    """The config checks take each kind's names from its registry (a kind registered there is accepted)."""
    for key, registry in {
        "parallel.dp_mode": MODES,
        "parallel.schedule": SCHEDULES,
        "model.family": FAMILIES,
        "parallel.cp_mode": CP_MODES,
        "train.activation_checkpointing": RECOMPUTE,
        "parallel.offload": OFFLOADS,
    }.items():
        assert CHOICES[key] is registry, key


def test_specs_name_code_that_exists():
    """Every name a spec gives to code on a higher floor resolves there (a typo fails here, not in a run): cp modes'
    attention cores (engine/parallel/cp/apply.py core_class) and planner models (engine/planning/cp.py), schedules'
    table builders (engine/parallel/pp/schedule.py table_builder), dp modes' classes (engine/parallel/dp) and
    planner models (engine/planning/dp.py)."""
    from engine.parallel.cp.apply import core_class
    from engine.parallel.dp import impl_class, state_classes
    from engine.parallel.pp.schedule import table_builder
    from engine.planning import dp as dp_plan
    from engine.planning.cp import model_class

    for spec in CP_MODES.values():
        assert callable(core_class(spec)) and callable(model_class(spec)), spec.name
    for spec in SCHEDULES.values():
        assert callable(table_builder(spec)), spec.name
    for spec in MODES.values():
        assert callable(impl_class(spec)) and all(map(callable, state_classes(spec))), spec.name
        assert spec.planner is None or callable(dp_plan.model_class(spec)), spec.name
    for spec in FAMILIES.values():  # an MoE family's gating is one engine/model/moe.py route computes
        assert spec.moe is None or spec.moe.gating in ("topk_softmax", "softmax_topk"), spec.name


def test_config_checks_read_the_registries_without_torch():
    """The config checks read every registry (dp modes, schedules, model families, cp modes, recompute modes,
    offload) before torch is loaded, so a bad config fails fast (launch/preflight.py loads one on a login node)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\nfrom engine.config import load\nload(['--parallel.dp_mode', 'zero', '--parallel.zero_stage', "
        "'1', '--parallel.schedule', 'gpipe', '--train.activation_checkpointing', 'selective', '--model.family', "
        "'qwen2', '--model.attention_bias', 'true', '--parallel.cp_mode', 'all_to_all', '--parallel.offload', "
        "'optimizer'])\nprint(sorted(m for m in ('torch', 'deepspeed') if m in "
        "sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
