"""A NaN or inf loss skips the update (every mode), is counted in metrics, and train.max_bad_steps in a row abort.

The fault is injected where it would arise in a real run: a forward hook on the final norm multiplies its output
by NaN on chosen steps, so the loss and every gradient behind it are NaN, on every dp rank.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from engine.config import ConfigError, load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer, TrainingAborted
from tests.dist import run_ranks
from tests.shrunk import FIVE_STEPS
from tests.trainer.modes import MODES, snapshot


def poisoned_run(argv: list[str], poison: list[int]) -> dict:
    """Rank function: train with NaN injected on the steps in ``poison`` (1-based); parameters after each step."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    hook = lambda module, args, out: out * float("nan") if trainer.step + 1 in poison else out  # noqa: E731
    if trainer.ctx.is_last_stage:
        trainer.model.model.norm.register_forward_hook(hook)
    records, params, error = [], [snapshot(trainer)], None
    try:
        while trainer.step < cfg.train.steps:
            records.append(trainer.train_step(trainer.next_local_batch()))
            params.append(snapshot(trainer))
    except TrainingAborted as e:
        error = str(e)
    return {"records": records, "params": params, "error": error}


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_loss_skips_the_update(tmp_path, mode):
    if mode.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    argv = [*FIVE_STEPS, *MODES[mode], "--parallel.dp", "2", "--train.out_dir", str(tmp_path)]
    got = run_ranks(poisoned_run, 2, argv, [3], timeout_s=300)[0]
    losses = [r["loss"] for r in got["records"]]
    assert len(losses) == 5 and math.isnan(losses[2]), losses
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != 2), losses
    assert [r.get("skipped_steps", 0) for r in got["records"]] == [0, 0, 1, 1, 1]
    before, after, later = got["params"][2], got["params"][3], got["params"][4]
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed in the skipped step"
        assert torch.isfinite(later[name]).all(), f"{name} is not finite after the skipped step"
    assert any(not torch.equal(after[n], later[n]) for n in after), "training did not go on after the skip"


def test_consecutive_bad_steps_abort(tmp_path):
    argv = [*FIVE_STEPS, "--train.max_bad_steps", "2", "--train.out_dir", str(tmp_path)]
    got = run_ranks(poisoned_run, 1, argv, [2, 3, 4])[0]
    assert len(got["records"]) == 2 and got["error"] is not None
    assert "2 steps in a row" in got["error"] and "train.max_bad_steps=2" in got["error"]


def test_max_bad_steps_must_not_be_negative():
    with pytest.raises(ConfigError, match="train.max_bad_steps=-1"):
        load([*FIVE_STEPS, "--train.max_bad_steps", "-1"])
