"""Each step's record carries throughput, TFLOP/s and MFU, memory and the time per phase
(engine/metrics/stepstats.py)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from engine.config import load
from engine.model.flops import flops_per_token
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from engine.trust import oplog
from tests.dist import run_ranks
from tests.metrics.stats import SMALL


def count_meetings(counts: dict) -> None:
    """Count this rank's blocking all-reduces per step (oplog's step number, set by fit) in ``counts``: the
    torch.distributed call itself, whoever makes it, logged or not; an async one (DDP's buckets) does not block."""
    real = dist.all_reduce

    def counted(*args, **kwargs):
        if not kwargs.get("async_op", False):
            counts[oplog.LOG.step] = counts.get(oplog.LOG.step, 0) + 1
        return real(*args, **kwargs)

    dist.all_reduce = counted


def two_steps(argv: list[str]) -> dict:
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    meetings: dict = {}
    count_meetings(meetings)
    history = trainer.fit()
    trainer.forward_backward(trainer.next_local_batch())  # grads held again, as right before an update
    return {"history": history, "held": sum(trainer.dp.bytes_held().values()), "meetings": meetings}


@pytest.mark.parametrize("extra", [[], ["--parallel.pp", "2"]], ids=["pp1", "pp2"])
def test_records_carry_throughput_mfu_memory_and_phases(tmp_path, extra):
    # log.every 2: step 1 is not logged, step 2 is (the last)
    argv = [*SMALL, *extra, "--train.out_dir", str(tmp_path), "--log.every", "2"]
    world = 2 if extra else 1
    ranks = run_ranks(two_steps, world, argv)
    result = ranks[-1]  # the last stage
    cfg = load(argv)
    for r in result["history"]:
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / world)
        tflops = r["tokens_per_s_per_device"] * flops_per_token(cfg.model, cfg.train.seq_len) / 1e12
        assert r["tflops"] == pytest.approx(tflops) and r["mfu"] == pytest.approx(tflops / 0.5)
        phases = r["time"]
        assert {"data", "forward", "backward", "optimizer", "pp_wait"} <= set(phases)
        assert phases["forward"] > 0 and phases["backward"] > 0
        assert (phases["pp_wait"] > 0) == bool(extra)  # the executor's receives, timed through the trainer's hook
        # Phases are disjoint parts of the step, data included (the step runs boundary to boundary).
        assert sum(phases.values()) <= r["step_time"] * 1.01
    assert [r.get("warmup", False) for r in result["history"]] == [True, False]
    # Peak memory is reduced over the ranks on logged steps only; a step meets in at most 2 blocking all-reduces
    # per rank off them (the loss with the stop flag, the grad norm; issue 46): pp 2 met in 4.
    assert max(r["meetings"].get(1, 0) for r in ranks) <= 2, [r["meetings"] for r in ranks]
    assert ["peak_mem_bytes" in r for r in result["history"]] == [False, True]
    assert result["history"][1]["mem_source"] == "tensors_held" and result["history"][1]["peak_mem_bytes"] > 0
    # The model state counted at the update is what a rank holds with gradients present; the record carries the
    # largest over ranks (at pp 2 the stages hold different bytes: the last one has the final norm), on every rank.
    held = [r["held"] for r in ranks]
    assert len(set(held)) == world
    assert [r["history"][-1]["peak_mem_bytes"] for r in ranks] == [max(held)] * world


SLOW = 0.2  # seconds added to the data phase and to the checkpointer's after_step (its stop-signal all-reduce)
EXCLUDED = 1.5  # seconds added to evaluation and to a checkpoint save, which a step's time leaves out


def slowed_fit(argv: list[str]) -> list[dict]:
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))

    def slowed(fn, seconds):
        def slow(*args, **kwargs):
            time.sleep(seconds)
            return fn(*args, **kwargs)

        return slow

    trainer.next_local_batch = slowed(trainer.next_local_batch, SLOW)
    trainer.checkpointer.after_step = slowed(trainer.checkpointer.after_step, SLOW)
    trainer.evaluate = slowed(trainer.evaluate, EXCLUDED)
    trainer.checkpointer.save = slowed(trainer.checkpointer.save, EXCLUDED)
    return trainer.fit()


def test_step_time_runs_from_record_to_record_with_data_and_logging(tmp_path):
    """Step 1 counts its data phase; step 2 also the after_step of step 1; step 3 leaves out step 2's evaluation
    and checkpoint save (both every 2 steps)."""
    argv = [
        *SMALL,
        "--train.steps",
        "3",
        "--train.eval_every",
        "2",
        "--train.eval_batches",
        "1",
        "--checkpoint.dir",
        str(tmp_path / "ckpt"),
        "--checkpoint.every",
        "2",
        "--train.out_dir",
        str(tmp_path),
    ]
    history = run_ranks(slowed_fit, 1, argv)[0]
    assert [r.get("warmup", False) for r in history] == [True, False, False]
    t = load(argv).train
    for r in history:
        assert r["time"]["data"] >= SLOW
        assert r["step_time"] >= sum(r["time"].values())
        assert r["tokens_per_s"] == pytest.approx(t.global_batch_size * t.seq_len / r["step_time"])
    assert history[1]["step_time"] >= sum(history[1]["time"].values()) + SLOW  # step 1's after_step
    assert history[2]["step_time"] - sum(history[2]["time"].values()) < EXCLUDED  # no evaluation, no save
