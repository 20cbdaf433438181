"""Context parallelism in the planner (engine/planning/cp.py) and the layout search: the bytes each cp mode moves and
the ring's wire buffers against what the engine's ring and all-to-all send on CPU (launch/bench/cp.py's rank
function counts them), and the search choosing cp for
long sequences only."""

import pytest

from engine.config import load
from engine.planning.search import Hardware, search
from launch.bench.cp import micro_batch
from tests.dist import run_ranks

ARGV = [
    "--config",
    "configs/tiny.yaml",
    "--model.num_layers",
    "2",
    "--train.seq_len",
    "64",
    "--train.micro_batch_size",
    "2",
]


@pytest.mark.parametrize(
    "mode,cp,extra",
    [
        ("ring", 2, []),
        ("ring", 4, []),
        ("ring", 2, ["--train.dtype", "bf16"]),
        ("all_to_all", 2, []),
        ("all_to_all", 4, []),
    ],
)
def test_planned_cp_bytes_are_what_the_engine_sends(mode, cp, extra):
    """Every byte the ring (K/V blocks forward and backward, dK/dV accumulators in fp32) and all_to_all (q, k, v, o and
    their gradients) send is counted by the planner, and the ring's buffers posted at once are its wire bytes."""
    argv = [*ARGV, "--parallel.cp", str(cp), "--parallel.cp_mode", mode, *extra]
    for got in run_ranks(micro_batch, cp, argv, threads=1):
        assert got["sent"] == got["planned_sent"] > 0, got
        assert got["wire"] == got["planned_wire"], got  # all_to_all: 0 == 0 (no ring buffers)


def _best(seq_len: int):
    cfg = load(
        [
            "--config",
            "configs/llama-3.1-8b.yaml",
            "--train.seq_len",
            str(seq_len),
            "--train.global_batch_size",
            "64",
            "--parallel.backend",
            "nccl",
        ]
    )
    return search(cfg, 8, Hardware())


def test_long_sequences_choose_cp_short_ones_do_not():
    """llama-3.1-8b on one node of 8 x 80 GB: at seq 131072 a layout without cp fits only with full recomputation
    (the activations of a whole sequence per rank; none fitted before issue 46's lean norm and SwiGLU), and cp > 1
    is faster; at seq 2048 one without cp fits and the cp layouts pay their communication for no gain, so cp == 1."""
    long = _best(131072)
    assert long[0].fits and long[0].layout.cp > 1
    without_cp = [p for p in long if p.fits and p.layout.cp == 1]
    assert all(p.cfg.train.activation_checkpointing == "full" for p in without_cp)
    assert all(p.time.total > long[0].time.total for p in without_cp)
    short = _best(2048)
    assert short[0].fits and short[0].layout.cp == 1
    with_cp = [p for p in short if p.fits and p.layout.cp > 1]
    assert with_cp and all(p.time.cp_comm > 0 for p in with_cp)


def test_cp_halves_the_compute_and_prices_the_all_to_all():
    """tiny (4 layers, 8 heads, 4 kv heads of 32, fp32) at cp 2: each rank computes on half the tokens, and
    all_to_all moves q, o (8 heads) and k, v (4) of its (4, 64) tokens, half of each, forward and backward, per layer
    and micro-batch (4 of them), on a 100 GB/s link with no latency."""
    from engine.planning.search import step_time
    from tests.planning.models import HW, tiny

    one = step_time(tiny(), 1, HW)
    two = step_time(tiny(cp=2, cp_mode="all_to_all", dp=1), 2, HW)
    assert two.compute == pytest.approx(one.compute / 2)
    per_layer = 2 * (8 + 4) * 32 * 4 * 64 * 4 / 2
    assert two.cp_comm == pytest.approx(4 * 4 * 2 * per_layer / 100e9)


def test_the_ring_is_priced_without_a_softmax_of_the_whole_sequence_on_any_kernel_path():
    """Issue 45 (CpModeSpec.saves_own_attention): on a GPU kernel path that keeps the (b, heads, s, s) softmax (SDPA's
    math path: fp32 with a head_dim not a multiple of 4), all_to_all's plain attention over the whole sequence keeps
    it, so its bytes a token grow with seq_len; the ring's core (engine/parallel/cp/ring.py) saves only its q, k, v,
    output and log-sum-exp, so its bytes a token do not. Planned for CUDA (parallel.backend=nccl) on any machine."""
    from engine.planning.activations import MATH, attention_bytes_per_token, planned_attention_path

    def per_token(mode: str, seq_len: int) -> float:
        argv = [*ARGV, "--parallel.backend", "nccl", "--model.head_dim", "30", "--train.seq_len", str(seq_len)]
        cfg = load([*argv, "--parallel.cp", "2", "--parallel.cp_mode", mode, "--model.num_kv_heads", "8"])
        assert planned_attention_path(cfg) == MATH
        return attention_bytes_per_token(cfg, 1)

    assert per_token("ring", 64) == per_token("ring", 128)
    assert per_token("all_to_all", 128) > per_token("all_to_all", 64)
