"""Independent oracle: our PipelineExecutor against torch.distributed.pipelining on CPU/gloo.

In each of pp ranks the stage is built twice from the same config and seed (``build_model`` gives identical
weights). One copy runs our executor, the other ``PipelineStage`` driven by ``Schedule1F1B`` (against our 1f1b)
or ``ScheduleGPipe`` (against our gpipe), on the same token batch cut into the same micro-batches. For two
consecutive steps (so stale state from a first run would show), every rank compares every parameter gradient
and the last stage compares the loss: fp32, rel err max|a-b|/max|b| <= 1e-5. At m = 4 and 8 the two agree bit
for bit (dividing by a power of two is exact, so scaling the loss before backward or the gradient after gives the
same bits); m = 6 (not a multiple of pp = 4, and inexact scaling) differs by rounding, ~1e-6.

Making the two comparable:
- Loss scaling. Our loss_fn returns each micro-batch's mean cross-entropy divided by the number of micro-batches
  (as Trainer.forward_backward does), so gradients accumulate to those of the mean. torch's schedules take an
  unscaled loss_fn and, with ``scale_grads=True`` (the default), divide every parameter gradient by
  ``n_microbatches`` after the last backward (``_PipelineStageBase.perform_reduce_grad``). The step's loss is our
  summed return value on one side, the mean of torch's per-micro-batch ``losses`` on the other.
- Metadata. ``PipelineStage`` gets ``input_args``/``output_args`` examples, so it runs in static mode (no extra
  metadata forward/backward): token ids (mbs, s) int64 on the first stage, hidden states (mbs, s, h) elsewhere;
  hidden states out, logits (mbs, s, V) on the last stage. The examples need ``requires_grad=True`` where the
  real tensors have it: torch derives from that flag whether an input is received as a grad-requiring leaf and
  whether gradient buffers are exchanged (with plain ``torch.empty`` examples the first stage's backward fails,
  "Failed to run stage backward ... Output gradient: ('None',)").
- Inputs. ``step`` splits the whole batch along dim 0 into equal micro-batches; we pass contiguous tensors.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

from engine.config import load  # noqa: E402
from engine.parallel.context import ParallelContext  # noqa: E402
from engine.parallel.pipeline import PipelineExecutor  # noqa: E402
from engine.parallel.tensor import vocab_parallel_cross_entropy  # noqa: E402
from engine.trainer import build_model  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

REL = 1e-5
MBS, STEPS = 2, 2
SMALL = ["--config", "configs/tiny.yaml", "--model.num_layers", "4", "--model.hidden_size", "64",
         "--model.intermediate_size", "128", "--model.num_heads", "4", "--model.num_kv_heads", "2",
         "--model.vocab_size", "512", "--train.seq_len", "32", "--train.micro_batch_size", str(MBS)]
TORCH_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
CASES = [pytest.param(pp, name, m, id=f"{name}-pp{pp}-m{m}")
         for pp in (2, 4) for name in TORCH_SCHEDULES for m in (4, 6, 8)]


def torch_schedule(model, cfg, ctx, name: str, m: int):
    """torch's PipelineStage around our stage module (static metadata) and its schedule with the same loss."""
    s, h, vocab = cfg.train.seq_len, cfg.model.hidden_size, cfg.model.vocab_size
    x = torch.zeros(MBS, s, dtype=torch.long) if ctx.is_first_stage else torch.empty(MBS, s, h, requires_grad=True)
    y = torch.empty(MBS, s, vocab if ctx.is_last_stage else h, requires_grad=True)
    stage = PipelineStage(model, ctx.pp_rank, ctx.pp, ctx.device, input_args=x, output_args=y, group=ctx.pp_group)
    return TORCH_SCHEDULES[name](stage, m, loss_fn=lambda logits, target: vocab_parallel_cross_entropy(
        logits, target, ctx.tp_group), scale_grads=True)


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max|a-b| / max|b|; inf when either side has no gradient or b is all zero (nothing was compared)."""
    if a is None or b is None or not b.abs().max() > 0:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max()).item()


def compare_on_rank(pp: int, name: str, m: int) -> dict:
    """Rank function: one step-pair per batch; returns per step the loss of each side and each gradient's error."""
    cfg = load([*SMALL, "--parallel.pp", str(pp), "--parallel.schedule", name,
                "--train.global_batch_size", str(m * MBS)])
    ctx = ParallelContext.from_config(cfg)
    ours, theirs = build_model(cfg, ctx), build_model(cfg, ctx)
    same_init = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    executor = PipelineExecutor(ctx, name, m, (MBS, cfg.train.seq_len, cfg.model.hidden_size), torch.float32)
    schedule = torch_schedule(theirs, cfg, ctx, name, m)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    steps = []
    for _ in range(STEPS):
        batch = torch.randint(0, cfg.model.vocab_size, (m * MBS, cfg.train.seq_len + 1), generator=gen)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (m*mbs, s) each
        ys = labels.split(MBS)
        loss_ours = executor.run(
            ours, lambda logits, mb: vocab_parallel_cross_entropy(logits, ys[mb], ctx.tp_group) / m,
            list(inputs.split(MBS)))
        losses: list[torch.Tensor] = []
        schedule.step(*([inputs] if ctx.is_first_stage else []),
                      **({"target": labels, "losses": losses} if ctx.is_last_stage else {}))
        grads = {n: rel_err(a.grad, b.grad)
                 for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters())}
        steps.append({"loss": (loss_ours.item(), torch.stack(losses).mean().item()) if losses else None,
                      "grads": grads})
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
    return {"stage": ctx.pp_rank, "last": ctx.is_last_stage, "same_init": same_init, "steps": steps}


@pytest.mark.parametrize("pp,name,m", CASES)
def test_executor_matches_torch_pipelining(pp, name, m):
    results = run_ranks(compare_on_rank, pp, pp, name, m)
    assert [r["stage"] for r in results] == list(range(pp))
    for r in results:
        stage = r["stage"]
        assert r["same_init"], f"stage {stage}: two build_model calls gave different weights"
        for step, got in enumerate(r["steps"]):
            assert got["grads"], f"stage {stage} holds no parameters"
            bad = {n: e for n, e in got["grads"].items() if not e <= REL}
            assert not bad, f"step {step} stage {stage}: gradients differ from torch's {name} (rel err): {bad}"
            if r["last"]:
                ours, theirs = got["loss"]
                assert abs(ours - theirs) <= REL * abs(theirs), f"step {step}: loss {ours} vs torch's {theirs}"
            else:
                assert got["loss"] is None
