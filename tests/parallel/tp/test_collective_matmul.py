"""parallel.tp_comm_overlap (engine/parallel/autograd/collective_matmul.py): the sequence-parallel linears with their
all-gathers and reduce-scatters run as rings of point-to-point transfers behind the matmul chunks, against the same
linears with one blocking collective (forward, every gradient, fp32 and bf16 autocast), what each issues, the
model under every recomputation mode, the trainer against one process, and the configurations refused."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from engine.config import ConfigError, load
from engine.parallel.autograd import comm
from tests.dist import run_ranks
from tests.parallel.tp.tp_step import loss_of, token_ids, tp_model

B, S, H, OUT = 2, 8, 6, 5  # (b, s, h) with s divisible by 2 and 4
# a model of 2 layers, hidden 64, 4 heads (2 kv) on 16-token sequences
SMALL = ["--config", "configs/tiny.yaml", "--model.num_layers", "2", "--model.hidden_size", "64"]
SMALL += ["--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "16"]


class _Counts:
    """``with _Counts(width) as counts:`` what this rank issues inside: blocking sequence collectives (all-gathers and
    reduce-scatters), point-to-point batches, and all-reduces of ``width`` elements (the activations'; the loss's
    all-reduce (b, s) statistics). The patched functions are put back on exit."""

    PATCHED = ((comm, "_all_gather_dim0", "blocking"), (comm, "_reduce_scatter_dim0", "blocking"))
    PATCHED += ((dist, "batch_isend_irecv", "batches"), (dist, "all_reduce", "all_reduces"))

    def __init__(self, width: int = -1):
        self.width, self.blocking, self.batches, self.all_reduces, self.saved = width, 0, 0, 0, []

    def __enter__(self) -> _Counts:
        for owner, name, field in self.PATCHED:
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, self._counted(getattr(owner, name), field))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)

    def _counted(self, fn, field: str):
        def call(*args, **kwargs):
            if field != "all_reduces" or args[0].numel() == self.width:
                setattr(self, field, getattr(self, field) + 1)
            return fn(*args, **kwargs)

        return call


def _linears(x, w, b, xr, wr, g, gr, overlap: bool) -> list[torch.Tensor]:
    """The column linear (x (b, s/tp, h) gathered, w, b) and the row one (xr (b, s, h/tp), wr), forward and
    backward with output gradients g and gr: [column out, row out, every input's gradient]."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b, xr, wr)]
    col = comm.sequence_gathered_linear(*leaves[:3], dist.group.WORLD, overlap)
    row = comm.sequence_reduced_linear(leaves[3], leaves[4], dist.group.WORLD, overlap=overlap)
    torch.autograd.backward([col, row], [g.to(col.dtype), gr.to(row.dtype)])
    return [col.detach(), row.detach()] + [t.grad for t in leaves]


def _layers_rank(dtype: str) -> dict:
    """The largest relative difference of every output and gradient with overlap from without, and the counts of
    each run's blocking collectives and point-to-point batches."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x, w, b = torch.randn(B, S // tp, H, generator=gen), torch.randn(OUT, H, generator=gen), torch.randn(OUT)
    xr, wr = torch.randn(B, S, H, generator=gen), torch.randn(OUT, H, generator=gen)
    g, gr = torch.randn(B, S, OUT, generator=gen), torch.randn(B, S // tp, OUT, generator=gen)
    runs, counts = {}, {}
    for overlap in (False, True):
        with _Counts() as counter, torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            runs[overlap] = _linears(x, w, b, xr, wr, g, gr, overlap)
        counts[overlap] = (counter.blocking, counter.batches)
    diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*runs.values()))
    return {"diff": diff, "counts": counts}


@pytest.mark.parametrize("tp,dtype", [(2, "fp32"), (4, "fp32"), (2, "bf16")])
def test_overlapped_linears_match_blocking_collectives(tp, dtype):
    for got in run_ranks(_layers_rank, tp, dtype, threads=1):
        # fp32: sums in another order, measured <= 3e-7; bf16: the row's partial sums added in bf16 in ring order,
        # where the library's reduce-scatter adds them in its own (one bf16 rounding, 2^-8 = 3.9e-3)
        assert got["diff"] <= (1e-6 if dtype == "fp32" else 8e-3), got
        # without: forward all-gather + reduce-scatter, backward 2 all-gathers + reduce-scatter; with: none, and
        # tp - 1 batches in each of the 5 rings
        assert got["counts"] == {False: (5, 0), True: (0, 5 * (tp - 1))}, got


def _model_rank(argv: list[str]) -> dict:
    """Loss and every gradient of one micro-batch at tp with sequence parallelism, overlapped against blocking,
    under each recomputation mode: the largest relative difference per mode."""
    cfg = load(argv)
    ids, errs = token_ids(cfg, 2), {}
    for mode in ("none", "full", "selective"):
        runs = []
        for overlap in (False, True):
            model = tp_model(cfg, True, overlap, mode)
            loss = loss_of(model, ids)
            loss.backward()
            runs.append([loss.detach()] + [p.grad for p in model.parameters()])
        errs[mode] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*runs))
    return errs


def test_model_with_overlap_matches_blocking_under_every_recomputation():
    for got in run_ranks(_model_rank, 2, SMALL + ["--parallel.tp", "2"], threads=1):
        assert max(got.values()) <= 1e-5, got  # fp32 sums in ring order


def _saved_rank(argv: list[str]) -> dict:
    """Peak bytes saved for backward over one micro-batch with and without overlap, and the planner's ledger."""
    from engine.metrics.memory import SavedActivations
    from engine.planning import activations as acts

    cfg, got = load(argv), {}
    ids = token_ids(cfg, 1)
    for overlap in (False, True):
        model = tp_model(cfg, True, overlap)
        tracker = SavedActivations(model)
        with tracker.hooks(), torch.autocast("cpu", torch.bfloat16, enabled=cfg.train.dtype == "bf16"):
            loss_of(model, ids).backward()
        got[overlap] = tracker.peak
    got["planned"] = acts.micro_batch_bytes(cfg, 2, 1, 0, cfg.model.num_layers)
    return got


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_overlap_saves_what_blocking_saves(dtype):
    """The rings keep nothing for backward beyond the blocking path's (b, s/tp, h) inputs: the same peak, which the
    activation ledger (engine/planning/activations.py) prices (measured: equal to 8 bytes, the loss's scalars)."""
    argv = SMALL + ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.dtype", dtype]
    for got in run_ranks(_saved_rank, 2, argv + ["--train.micro_batch_size", "1"], threads=1):
        assert got[True] == got[False] == pytest.approx(got["planned"], rel=1e-3), got


def _rings_rank(argv: list[str]) -> dict:
    """One micro-batch of the model at tp 2 with sequence parallelism and overlap, per recomputation mode: the
    point-to-point batches (one per ring at tp 2) and blocking collectives issued, forward and backward together."""
    cfg = load(argv)
    ids, counts = token_ids(cfg, 2), {}
    for mode in ("none", "full", "selective"):
        model = tp_model(cfg, True, True, mode)
        with _Counts() as counter:
            loss_of(model, ids).backward()
        counts[mode] = (counter.batches, counter.blocking)
    return counts


def test_planner_prices_every_ring_the_model_runs():
    """engine/planning/tp.py against the engine: on a device so fast that no matmul hides a transfer, the planned
    exposed seconds of a stage holding the embedding, every layer and the LM head are (rings + 2 blocking halves)
    ring steps, with the rings and blocking collectives counted in the model under each recomputation mode."""
    from engine.planning import tp as tp_plan
    from engine.planning.search import Hardware

    argv = SMALL + ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.tp_comm_overlap", "true"]
    got = run_ranks(_rings_rank, 2, argv, threads=1)[0]
    hw = Hardware(peak_tflops=1e15)  # every matmul chunk ~0 s: each ring step exposed whole
    for mode, (rings, blocking) in got.items():
        cfg = load(argv + ["--train.activation_checkpointing", mode])
        tokens = 2 * cfg.train.seq_len
        step = tokens * cfg.model.hidden_size * 4 / 2 / (hw.intra_node_gbps * 1e9) + hw.latency_us * 1e-6
        planned = sum(tp_plan.comm_time(cfg, 2, hw, tokens, cfg.model.num_layers, 0, (True, True)))
        # blocking: the embedding's reduce-scatter forward and all-gather backward, one ring's two halves
        assert (blocking, round(planned / step, 6)) == (2, rings + blocking), (mode, rings, blocking, planned / step)


def _blocking_rank(argv: list[str]) -> dict:
    """One micro-batch of the model at tp 2 without overlap, with and without sequence parallelism, per
    recomputation mode: the blocking collectives on (b, s, h) activations, in rings (an all-reduce, or an all-gather
    and a reduce-scatter: half a ring each), forward and backward together."""
    cfg = load(argv)
    ids, counts = token_ids(cfg, 2), {}
    width = 2 * cfg.train.seq_len * cfg.model.hidden_size  # a (b, s, h) activation
    for sp in (False, True):
        for mode in ("none", "full", "selective"):
            model = tp_model(cfg, sp, recompute=mode)
            with _Counts(width) as counter:
                loss_of(model, ids).backward()
            counts[sp, mode] = counter.all_reduces + counter.blocking / 2
    return counts


def test_planner_prices_every_blocking_collective_the_model_runs():
    """engine/planning/tp.py's blocking rings against the model's: a stage with the embedding, every layer and the LM
    head, with and without sequence parallelism, under each recomputation mode."""
    from engine.planning import tp as tp_plan

    got = run_ranks(_blocking_rank, 2, SMALL + ["--parallel.tp", "2"], threads=1)[0]
    for (sp, mode), rings in got.items():
        flags = ["--parallel.sequence_parallel", str(sp).lower(), "--train.activation_checkpointing", mode]
        cfg = load(SMALL + ["--parallel.tp", "2", *flags])
        planned = sum(tp_plan.blocking_rings(cfg, cfg.model.num_layers, 0, (True, True)))
        assert planned == rings, (sp, mode, planned, rings)


def test_trainer_with_overlap_matches_single_process(tmp_path):
    """tp 2 x pp 2 with sequence parallelism and the overlapped collectives, selective recomputation, against one
    process without any: loss and grad norm every step, clipping off (the parity matrix's bounds)."""
    from tests.parity import matrix, runner

    pytest.importorskip("deepspeed")  # tests.parity.runner imports the trainer's dp modes
    ref = matrix.Combo(1, 1, 1, "ddp", "-", "fp32", False, False, False)
    combo = matrix.Combo(2, 2, 1, "ddp", "1f1b", "fp32", False, False, False, sp=True)
    want = runner.run_group(1, [runner.combo_argv(ref, str(tmp_path / "ref"))], want_init=True)[0][0]
    extra = ("--parallel.tp_comm_overlap", "true", "--train.activation_checkpointing", "selective")
    got = runner.run_group(4, [runner.combo_argv(combo, str(tmp_path / "overlap"), *extra)])[0]
    runner.assert_matches(got, want)


@pytest.mark.parametrize(
    "extra,words",
    [
        ([], "parallel.tp_comm_overlap=true needs parallel.sequence_parallel=true"),
        (
            ["--parallel.sequence_parallel", "true", "--parallel.pp", "2", "--parallel.schedule", "zero_bubble"],
            "parallel.tp_comm_overlap=true is not supported with parallel.schedule=zero_bubble",
        ),
    ],
)
def test_overlap_refusals(extra, words):
    from engine.parallel.layout.checks import resolve_layout

    cfg = load(SMALL + ["--parallel.tp", "2", "--parallel.tp_comm_overlap", "true"] + extra)
    with pytest.raises(ConfigError, match=re.escape(words)):
        resolve_layout(cfg, cfg.parallel.tp * cfg.parallel.pp)
