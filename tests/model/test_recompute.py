"""Activation checkpointing modes (engine/model/recompute.py): full and selective give the loss and every gradient
of no checkpointing (fp32), at tp = 1 and tp = 2; selective keeps less than none and more than full, also under
sequence parallelism at tp 4 (where it kept the full-width row-parallel outputs); what each mode keeps, with and
without sequence parallelism, is the activation ledger's figure (engine/planning/activations.py); the RMSNorm saves
only its input and rstd; the old boolean spellings still load."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from engine.config import Config, ConfigError, ModelConfig, TrainConfig, load
from engine.metrics.memory import LiveTensorBytes, SavedActivations
from engine.model import transformer as model_lib
from engine.model.init import materialize
from engine.model.recompute import apply_activation_checkpointing
from engine.parallel.autograd.weight_grad import WeightGradStore, split_weight_gradients
from engine.parallel.tp.layers import RowParallelLinear, apply_tensor_parallel, vocab_parallel_cross_entropy
from engine.planning import activations as acts
from engine.planning.activations import checkpointed_layer_bytes_per_token
from tests.dist import run_ranks

SHAPE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
# Measured: recomputation repeats the same ops on the same values, so loss and gradients are bitwise equal (0.0)
# at tp = 1 and 2; the bound only allows for a kernel choosing another reduction order when recomputing.
REL = 1e-6


def _run(mode: str, group=None) -> tuple[torch.Tensor, dict, int]:
    """(loss, gradients by name, bytes allocated by the forward and still alive at the loss) of one step."""
    model = model_lib.build(SHAPE, device="meta")
    if group is not None:
        apply_tensor_parallel(model, group)
    materialize(model, torch.device("cpu"), seed=0, std=0.1)
    apply_activation_checkpointing(model, mode)
    ids = torch.randint(0, SHAPE.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with LiveTensorBytes() as live:
        loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], group)
        kept = live.live
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept


def _worst(a: tuple, b: tuple) -> float:
    errs = [((a[0] - b[0]).abs() / b[0].abs()).item()]
    errs += [((a[1][n] - g).abs().max() / g.abs().max()).item() for n, g in b[1].items()]
    return max(errs)


def _compare(group=None) -> dict:
    runs = {mode: _run(mode, group) for mode in ("none", "full", "selective")}
    return {
        "full": _worst(runs["full"], runs["none"]),
        "selective": _worst(runs["selective"], runs["none"]),
        "kept": {mode: r[2] for mode, r in runs.items()},
    }


def _tp_rank() -> dict:
    return _compare(dist.group.WORLD)


def test_modes_match_no_checkpointing_and_keep_less():
    got = _compare()
    assert got["full"] <= REL and got["selective"] <= REL, got
    kept = got["kept"]
    assert kept["full"] < kept["selective"] < kept["none"], kept
    # What selective keeps beyond full (the matmul outputs) is what the planner counts, exactly.
    cfg = {m: Config(model=SHAPE, train=TrainConfig(activation_checkpointing=m)) for m in ("full", "selective")}
    extra = checkpointed_layer_bytes_per_token(cfg["selective"], 1) - checkpointed_layer_bytes_per_token(cfg["full"], 1)
    assert kept["selective"] - kept["full"] == extra * 2 * 16 * SHAPE.num_layers  # (2, 16) tokens


def test_modes_match_at_tp2():
    for got in run_ranks(_tp_rank, 2):
        assert got["full"] <= REL and got["selective"] <= REL, got
        assert got["kept"]["full"] < got["kept"]["selective"] < got["kept"]["none"], got["kept"]


# ---- what each mode keeps at tp > 1, with and without sequence parallelism, against the ledger ---------------------
TINY = ["--config", "configs/tiny.yaml", "--model.num_layers", "2", "--train.seq_len", "32"]
TINY += ["--train.micro_batch_size", "2", "--train.global_batch_size", "2"]


def _kept(argv: list[str], mode: str, sp: bool, split_w: bool = False) -> dict:
    """Bytes allocated by one micro-batch's forward and alive at the loss on this tp rank (what the step keeps for
    backward: LiveTensorBytes also sees what checkpointing keeps), and the ledger's micro_batch_bytes; ``split_w``:
    zero bubble's backward, B deferring the linears' weight gradients to W (engine/parallel/autograd/weight_grad.py),
    and the gradients it gave."""
    tp = dist.get_world_size()
    argv = argv + ["--parallel.tp", str(tp), "--parallel.sequence_parallel", str(sp).lower()]
    cfg = load(argv + ["--train.activation_checkpointing", mode, "--parallel.schedule", SPLIT_W[split_w]])
    model = model_lib.build(cfg.model, device="meta")
    apply_tensor_parallel(model, dist.group.WORLD, sp)
    materialize(model, torch.device("cpu"), seed=0, std=0.02)
    if acts.mode(cfg) == "bf16":  # fsdp's bf16 compute weights
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, mode)
    store = WeightGradStore()
    if split_w:
        split_weight_gradients(model, store)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(1))
    with LiveTensorBytes() as live:
        loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], dist.group.WORLD)
        kept = live.live
    with store.defer(0) if split_w else contextlib.nullcontext():
        loss.backward()
    rows = [m.weight for m in model.modules() if isinstance(m, RowParallelLinear)]
    deferred = all(id(w) in store.queued(0) for w in rows)  # each row-parallel weight's gradient waits for W
    store.flush(0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    planned = acts.micro_batch_bytes(cfg, tp, 1, 0, cfg.model.num_layers)
    return {"kept": kept, "planned": planned, "grads": grads, "deferred": deferred}


SPLIT_W = {False: "1f1b", True: "zero_bubble"}


def _ledger_rank(argv: list[str]) -> dict:
    got = {(sp, mode): _kept(argv, mode, sp) for sp in (False, True) for mode in ("none", "selective", "full")}
    return {where: {k: v for k, v in g.items() if k != "grads"} for where, g in got.items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: bf16 weights (fsdp's compute copy), not autocast
def test_kept_activations_match_the_ledger_at_tp2(dtype):
    argv = TINY + ["--train.dtype", dtype, "--parallel.dp_mode", "fsdp" if dtype == "bf16" else "ddp"]
    for got in run_ranks(_ledger_rank, 2, argv, threads=1):
        for where, g in got.items():  # measured: within 16 bytes (the loss's scalars) of ~0.3-1.3 MB
            assert g["kept"] == pytest.approx(g["planned"], rel=0.02), (where, g)
        for sp in (False, True):
            assert got[sp, "full"]["kept"] < got[sp, "selective"]["kept"] < got[sp, "none"]["kept"], got


def _sp_modes_rank(argv: list[str]) -> dict:
    return {mode: _kept(argv, mode, True)["kept"] for mode in ("none", "selective")}


def _zero_bubble_rank(argv: list[str]) -> dict:
    """Selective and none under zero bubble's split backward with sequence parallelism: kept bytes, the ledger's,
    and the worst relative gradient difference of selective's from none's."""
    got = {mode: _kept(argv, mode, True, split_w=True) for mode in ("none", "selective")}
    worst = max(
        ((g - got["none"]["grads"][n]).abs().max() / got["none"]["grads"][n].abs().max()).item()
        for n, g in got["selective"]["grads"].items()
    )
    return {mode: (g["kept"], g["planned"], g["deferred"]) for mode, g in got.items()} | {"worst": worst}


def test_selective_keeps_less_than_none_under_sequence_parallelism():
    # tp 4 with a narrow MLP (f = h/2): selective kept o_proj's and down_proj's (b, s, h) partial sums, full width
    # on every rank, and so more than no recomputation (measured on the base: 1.07x); it keeps their reduce-scattered
    # (b, s/tp, h) shards now
    argv = TINY + ["--model.intermediate_size", "64"]
    for got in run_ranks(_sp_modes_rank, 4, argv, threads=1):
        assert got["selective"] < got["none"], got


def test_selective_under_zero_bubble_keeps_the_sequence_shards_and_defers_their_weight_gradients():
    """Zero bubble's deferred weight gradients and selective recomputation under sequence parallelism (tp 4, the
    narrow MLP above): the row-parallel linears keep their (b, s/tp, h) shards as without zero bubble (they kept
    the (b, s, h) partial sums, more than no recomputation: 1.07x), the ledger's figure, and W gives the gradients
    of no recomputation."""
    argv = TINY + ["--model.intermediate_size", "64"]
    for got in run_ranks(_zero_bubble_rank, 4, argv, threads=1):
        assert got["selective"][0] < got["none"][0], got
        for kept, planned, deferred in (got["none"], got["selective"]):
            assert kept == pytest.approx(planned, rel=0.02) and deferred, got
        assert got["worst"] <= REL, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_saves_its_input_and_rstd_only(dtype):
    """The norm keeps x as given and one fp32 rstd a row (no fp32 copy of a bf16 x, no x_n), and gives the output
    and gradients of the op-by-op fp32 formula (HF Llama's) it replaced."""
    norm = model_lib.RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    norm.to(dtype)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
    tracker = SavedActivations(norm)
    with tracker.hooks():
        y = norm(x)
    assert tracker.peak == x.numel() * x.element_size() + 2 * 8 * 4  # x and rstd (b, s, 1) fp32
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = torch.autograd.grad(y, (x, norm.weight), g)
    xf = x.float()
    want_y = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    want = torch.autograd.grad(want_y, (x, norm.weight), g)
    assert torch.equal(y, want_y)
    for a, b in zip(got, want):  # measured: 0 in bf16, 5e-8 relative in fp32 (another order of the same sums)
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-6


@pytest.mark.parametrize(
    "value,mode", [("true", "full"), ("false", "none"), ("selective", "selective"), ("none", "none")]
)
def test_old_boolean_spellings_load(value, mode):
    assert load(["--train.activation_checkpointing", value]).train.activation_checkpointing == mode


def test_bad_mode_is_refused():
    with pytest.raises(ConfigError, match="train.activation_checkpointing='some' is not one of none, full, selective"):
        load(["--train.activation_checkpointing", "some"])
