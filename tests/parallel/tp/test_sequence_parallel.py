"""Sequence parallelism (Korthikanti et al. 2022; parallel.sequence_parallel): the sequence collectives of
engine/parallel/autograd/comm.py against an all-gather reference, forward and backward; the activations each rank keeps
(the residual stream is (b, s/tp, h)) against the planner's ledger; selective recomputation under it against one
process. The trainer's parity at tp 2 and 4 with pp, every dp mode and full recomputation is the parity matrix's
``sp`` axis (tests/parity/matrix.py)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import load
from engine.metrics.memory import SavedActivations
from engine.parallel.autograd.comm import (
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    sequence_gathered_linear,
)
from engine.planning import activations as acts
from tests.dist import run_ranks
from tests.parallel.tp.tp_step import loss_of, token_ids, tp_model

B, S, H, OUT = 2, 8, 6, 5  # (b, s, h) with s divisible by 2 and 4


def _all(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` (the reference collective: a list all-gather)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _collectives_rank() -> dict:
    """Each function's output and input gradient on this rank, minus what the all-gather reference gives: the
    largest absolute difference of each (0 when exact)."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    errs = {}
    # all-gather forward, reduce-scatter backward: out = cat(x_r); dL/dx_r = sum over ranks q of chunk r of g_q
    x = torch.randn(B, S // tp, H, generator=gen, requires_grad=True)
    g = torch.randn(B, S, H, generator=gen)
    out = gather_from_sequence_parallel(x, dist.group.WORLD)
    out.backward(g)
    want_grad = sum(gq.chunk(tp, 1)[rank] for gq in _all(g))
    errs["gather"] = max((out - torch.cat(_all(x.detach()), 1)).abs().max(), (x.grad - want_grad).abs().max())
    # reduce-scatter forward, all-gather backward: out = chunk r of sum_q y_q; dL/dy = cat(g_q)
    y = torch.randn(B, S, H, generator=gen, requires_grad=True)
    g = torch.randn(B, S // tp, H, generator=gen)
    out = reduce_scatter_to_sequence_parallel(y, dist.group.WORLD)
    out.backward(g)
    want = sum(_all(y.detach())).chunk(tp, 1)[rank]
    errs["reduce_scatter"] = max((out - want).abs().max(), (y.grad - torch.cat(_all(g), 1)).abs().max())
    # the column-parallel linear on the gathered input: against F.linear on the reference-gathered input
    x = torch.randn(B, S // tp, H, generator=gen, requires_grad=True)
    w = torch.randn(OUT, H, generator=gen, requires_grad=True)
    b = torch.randn(OUT, generator=gen, requires_grad=True)
    g = torch.randn(B, S, OUT, generator=gen)
    out = sequence_gathered_linear(x, w, b, dist.group.WORLD)
    out.backward(g)
    full = torch.cat(_all(x.detach()), 1).requires_grad_(True)
    w_ref, b_ref = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref = F.linear(full, w_ref, b_ref)
    ref.backward(g)
    want_x = sum(_all(full.grad)).chunk(tp, 1)[rank]  # every rank's output depends on this rank's chunk
    errs["linear"] = max(
        (out - ref).abs().max(),
        (x.grad - want_x).abs().max(),
        (w.grad - w_ref.grad).abs().max(),
        (b.grad - b_ref.grad).abs().max(),
    )
    return {k: float(v) for k, v in errs.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_collectives_match_all_gather_reference(tp):
    for got in run_ranks(_collectives_rank, tp, threads=1):
        assert all(err <= 1e-5 for err in got.values()), got  # fp32 sums in another order


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--parallel.tp", "1"], "parallel.sequence_parallel=true needs parallel.tp >= 2 (got tp=1)"),
        (["--parallel.tp", "4", "--train.seq_len", "30"], "needs train.seq_len=30 divisible by parallel.tp=4"),
    ],
)
def test_sequence_parallel_refusals(extra, words):
    from engine.config import ConfigError
    from engine.parallel.layout.checks import resolve_layout

    cfg = load(SMALL + ["--parallel.sequence_parallel", "true"] + extra)
    with pytest.raises(ConfigError, match=re.escape(words)):
        resolve_layout(cfg, cfg.parallel.tp)


def test_group_of_one_is_identity():
    x = torch.randn(B, S, H)
    assert gather_from_sequence_parallel(x, None) is x and reduce_scatter_to_sequence_parallel(x, None) is x


# ---- activations per rank: the residual stream shrinks by tp, and the ledger counts what autograd saves ----------
SMALL = [
    "--config",
    "configs/tiny.yaml",
    "--model.hidden_size",
    "128",
    "--model.intermediate_size",
    "256",
    "--model.num_heads",
    "4",
    "--model.num_kv_heads",
    "4",
    "--model.num_layers",
    "2",
    "--train.seq_len",
    "32",
    "--train.micro_batch_size",
    "2",
    "--train.global_batch_size",
    "2",
]


def _activations_rank(argv: list[str]) -> dict:
    """One micro-batch through the tp-parallel model and the loss on this rank: bytes of each decoder layer's
    output (the residual stream) and the peak of bytes saved for backward, with the planner's figure."""
    cfg = load(argv)
    tp = dist.get_world_size()
    model = tp_model(cfg, cfg.parallel.sequence_parallel)
    residual = []
    for layer in model.model.layers.values():
        layer.register_forward_hook(lambda m, i, o: residual.append(o.numel() * o.element_size()))
    ids = token_ids(cfg, cfg.train.micro_batch_size)
    tracker = SavedActivations(model)
    with tracker.hooks(), torch.autocast("cpu", torch.bfloat16, enabled=cfg.train.dtype == "bf16"):
        loss = loss_of(model, ids)
    loss.backward()
    return {
        "residual": max(residual),
        "saved": tracker.peak,
        "planned": acts.micro_batch_bytes(cfg, tp, 1, 0, cfg.model.num_layers),
    }


@pytest.mark.parametrize("tp,dtype", [(2, "fp32"), (4, "fp32"), (2, "bf16")])  # bf16: autocast over fp32 weights
def test_sequence_parallel_shrinks_residual_stream_and_matches_ledger(tp, dtype):
    argv = SMALL + ["--train.dtype", dtype]
    tp_only = run_ranks(_activations_rank, tp, argv, threads=1)
    sp = run_ranks(
        _activations_rank, tp, argv + ["--parallel.tp", str(tp), "--parallel.sequence_parallel", "true"], threads=1
    )
    for without, with_sp in zip(tp_only, sp):
        assert with_sp["residual"] * tp == without["residual"], (without, with_sp)
        assert with_sp["saved"] < without["saved"]
        for got in (without, with_sp):  # the ledger leaves out a few scalars of the loss
            assert got["saved"] == pytest.approx(got["planned"], rel=1e-3), got


# ---- RoPE positions and document masking act on the whole sequence inside attention ------------------------------
def _positions_rank(argv: list[str]) -> dict:
    """Loss and gradients at tp with and without sequence parallelism, on default positions and on packed
    documents (position_ids restart, block-causal mask): the largest relative difference."""
    from engine.model.docmask import document_layout

    cfg = load(argv)
    ids = torch.randint(
        0, 16, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )  # token 3 is the EOS: ~6 % of the tokens
    position_ids, doc_ids = document_layout(ids[:, :-1], eos_id=3)
    errs = {}
    for docs in (False, True):
        runs = []
        for sp in (False, True):
            model = tp_model(cfg, sp)
            kw = {"position_ids": position_ids, "doc_ids": doc_ids} if docs else {}
            loss = loss_of(model, ids, **kw)
            loss.backward()
            runs.append([loss.detach()] + [p.grad for p in model.parameters()])
        errs[docs] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*runs))
    return errs


def test_positions_and_document_mask_cover_the_whole_sequence():
    for got in run_ranks(_positions_rank, 2, SMALL + ["--parallel.tp", "2"], threads=1):
        assert max(got.values()) <= 1e-5, got


# ---- recomputation under sequence parallelism ---------------------------------------------------------------------
def _recompute_rank(argv: list[str]) -> dict:
    """Loss and every gradient of one micro-batch at tp with sequence parallelism, under each recomputation mode:
    the largest relative difference of full and selective from none (their collectives run again in backward;
    selective caches the matmul outputs, the partial sums before a reduce-scatter among them)."""
    cfg = load(argv)
    ids, runs = token_ids(cfg, cfg.train.micro_batch_size), {}
    for mode in ("none", "full", "selective"):
        model = tp_model(cfg, True, recompute=mode)
        loss = loss_of(model, ids)
        loss.backward()
        runs[mode] = [loss.detach()] + [p.grad for p in model.parameters()]
    return {
        mode: max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(runs[mode], runs["none"]))
        for mode in ("full", "selective")
    }


def test_recomputation_under_sequence_parallel_matches_none():
    for got in run_ranks(_recompute_rank, 2, SMALL + ["--parallel.tp", "2"], threads=1):
        assert got["full"] <= 1e-6 and got["selective"] <= 1e-6, got  # measured: 0.0 (the same ops again)


@pytest.mark.slow
def test_selective_recompute_with_sequence_parallel_matches_single_process(tmp_path):
    """tp 2 with sequence parallelism and selective recomputation (its collectives run again in backward; the
    matmul outputs are cached) against one process without either: loss and grad norm every step, clipping off."""
    from tests.parity import matrix, runner  # the parity runner: the same model, data and bounds

    pytest.importorskip("deepspeed")  # tests.parity.runner imports the trainer's dp modes
    ref = matrix.Combo(1, 1, 1, "ddp", "-", "fp32", False, False, False)
    combo = matrix.Combo(2, 1, 1, "ddp", "-", "fp32", False, False, False, sp=True)
    want = runner.run_group(1, [runner.combo_argv(ref, str(tmp_path / "ref"))], want_init=True)[0][0]
    argv = runner.combo_argv(combo, str(tmp_path / "sp"), "--train.activation_checkpointing", "selective")
    got = runner.run_group(2, [argv])[0]
    runner.assert_matches(got, want)
