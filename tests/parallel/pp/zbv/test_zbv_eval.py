"""ZB-V's evaluation table (schedule.forward_only with vshape: every micro-batch down chunk 0, then back up chunk
1, the turn handed over on rank pp-1) against one process: the held-out loss of the same weights, tied and
untied (the tied embedding and head one parameter on rank 0). Measured equal bit for bit at pp 2; bound 1e-6."""

from __future__ import annotations

import pytest

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.parity.runner import BASE

REL = 1e-6


def eval_loss(extra: list[str], out: str) -> float:
    cfg = load([*BASE, *extra, "--train.out_dir", out, "--train.eval_batches", "2"])
    return Trainer(cfg, ParallelContext.from_config(cfg)).evaluate()


@pytest.mark.parametrize("tied", ["false", "true"])
def test_zbv_evaluation_matches_one_process(tmp_path, tied):
    common = ["--model.tie_embeddings", tied]
    (want,) = run_ranks(eval_loss, 1, common, str(tmp_path / "one"))
    got = run_ranks(eval_loss, 2, [*common, "--parallel.pp", "2", "--parallel.schedule", "zbv"], str(tmp_path / "v"))
    assert all(abs(g - want) <= REL * abs(want) for g in got), (got, want)
