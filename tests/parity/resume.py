"""Resume parity: save at one layout, resume at another, and compare with the uninterrupted single process.

Each scenario (matrix.resume_scenarios) trains its source combination for all ``STEPS`` steps with a checkpoint
at step ``SAVE_AT`` (the source run is itself compared with the reference), then resumes that checkpoint at the
target combination and trains to the end. The resumed steps' losses and grad norms and the final parameters are
compared with the single-process run that was never interrupted, so weights, both Adam moments, the step count
and the data position must all have crossed the change of tp, pp, dp, dp mode and schedule intact. The target
keeps the source's dtype, embeddings and clipping (those are the run's, not the layout's).
"""

from __future__ import annotations

from dataclasses import replace

from tests.parity.matrix import Combo, Resume
from tests.parity.runner import STEPS, Outcome, combo_argv, compare, run_group, tolerance, verdict

SAVE_AT = STEPS // 2


def _plain(c: Combo) -> Combo:
    """The uninterrupted single-process run: the plain trainer with the run's dtype, embeddings and clipping."""
    return Combo(1, 1, 1, "ddp", "-", c.dtype, c.tied, False, c.clip, layers=c.layers, model=c.model)


def _target(s: Resume):
    return replace(s.target, dtype=s.source.dtype, tied=s.source.tied, clip=s.source.clip)


def _by_world(items: list) -> dict:
    out: dict[int, list] = {}
    for key, combo, argv in items:
        out.setdefault(combo.world, []).append((key, argv))
    return out


def _run_all(items: list) -> dict:
    """items: (key, combo, argv); runs them grouped by world size; returns {key: per-rank results or error}."""
    out = {}
    for world, group in sorted(_by_world(items).items()):
        try:
            runs = run_group(world, [argv for _, argv in group])
        except Exception as e:  # noqa: BLE001 - reported per scenario
            runs = [f"ranks failed: {str(e).strip().splitlines()[-1][:300]}"] * len(group)
        out.update({key: run for (key, _), run in zip(group, runs)})
    return out


def run_resumes(scenarios: list[Resume], root) -> dict:
    """{scenario: Outcome} for the resumed part (steps SAVE_AT+1 .. STEPS) against the uninterrupted reference;
    a failure of the source run is reported as the scenario's failure."""
    refs = sorted({_plain(s.source) for s in scenarios})
    ref_of = {
        r: run[0]
        for r, run in zip(refs, run_group(1, [combo_argv(r, f"{root}/ref-{r.name}") for r in refs], want_init=True))
    }
    ckpt = {s: f"{root}/ckpt-{i}" for i, s in enumerate(scenarios)}
    sources = _run_all(
        [
            (
                s,
                s.source,
                combo_argv(
                    s.source,
                    f"{ckpt[s]}-out",
                    "--checkpoint.dir",
                    ckpt[s],
                    "--checkpoint.every",
                    str(SAVE_AT),
                    "--checkpoint.resume",
                    "none",
                ),
            )
            for s in scenarios
        ]
    )
    targets = _run_all(
        [
            (
                s,
                _target(s),
                combo_argv(_target(s), f"{ckpt[s]}-resumed", "--checkpoint.resume", f"{ckpt[s]}/step_{SAVE_AT:06d}"),
            )
            for s in scenarios
        ]
    )
    out = {}
    for s in scenarios:
        ref, failure = ref_of[_plain(s.source)], None
        tol = tolerance(s.source)
        for what, run, offset in (("source", sources[s], 0), ("resumed", targets[s], SAVE_AT)):
            if isinstance(run, str) or "error" in run[0]:
                failure = failure or f"{what}: {run if isinstance(run, str) else run[0]['error']}"
                continue
            errors = compare(run, ref, offset)
            failure = failure or (f"{what}: {bad}" if (bad := verdict(errors, tol)) else None)
        out[s] = Outcome(errors if failure is None else {}, failure, 0.0)
    return out
