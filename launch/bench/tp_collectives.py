"""Benchmark (table d of launch/bench/tp.py): tensor-parallel collectives per decoder layer, counted.

    python launch/bench/tp_collectives.py [--config configs/tiny.yaml] [--tp 2 4] [--micro-batch-size 2] [--seq-len 16]

One forward and one backward of one decoder layer (engine/model/transformer.py DecoderLayer, parallelised by
engine/parallel/tp/layers.py) on forked gloo ranks, for each tp, sequence parallelism off/on and activation
checkpointing none/full. Every collective is seen where it reaches the process group: a TorchDispatchMode on the
c10d ops (as torch.distributed.tensor.debug.CommDebugMode counts them), so a collective counts however the Python
code names it (engine/parallel/autograd/comm.py holds its own reference to all_gather_single). Printed per layer,
forward and backward: the calls of each kind, and per token of the micro-batch (b * s tokens) the bytes of the full
buffer each kind reduces or assembles (an all-reduce's tensor, an all-gather's output, a reduce-scatter's input)
and the bytes one rank sends under ring algorithms (all-reduce 2 (tp-1)/tp of the buffer, all-gather and
reduce-scatter (tp-1)/tp; Thakur et al. 2005), next to the counts of Megatron's design
(Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022, Sec. 4.2.2). tests/parallel/tp/test_tp_collectives.py asserts
the counts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from engine.config import load  # noqa: E402
from engine.model import transformer as model_lib  # noqa: E402
from engine.model.init import materialize  # noqa: E402
from engine.model.recompute import set_recompute  # noqa: E402
from engine.model.rope import rope_cos_sin  # noqa: E402
from engine.parallel.autograd.comm import SEQUENCE_REDUCED_LINEAR  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.parallel.tp.layers import apply_tensor_parallel  # noqa: E402

_c10d = torch.ops.c10d
# c10d op -> the kind reported; every op a torch.distributed collective lowers to on a ProcessGroup.
KINDS = {
    _c10d.allreduce_: "all_reduce",
    _c10d.allreduce_coalesced_: "all_reduce",
    _c10d.allgather_: "all_gather",
    _c10d._allgather_base_: "all_gather",
    _c10d.allgather_coalesced_: "all_gather",
    _c10d.allgather_into_tensor_coalesced_: "all_gather",
    _c10d.reduce_scatter_: "reduce_scatter",
    _c10d._reduce_scatter_base_: "reduce_scatter",
    _c10d.reduce_scatter_tensor_coalesced_: "reduce_scatter",
    _c10d.broadcast_: "broadcast",
    _c10d.alltoall_: "all_to_all",
    _c10d.alltoall_base_: "all_to_all",
    _c10d.reduce_: "reduce",
    _c10d.gather_: "gather",
    _c10d.scatter_: "scatter",
    _c10d.barrier: "barrier",
}
SHOWN = ("all_reduce", "all_gather", "reduce_scatter")


def _bytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_bytes(a) for a in arg)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives run while active, per ``phase``: {phase: {kind: [calls, buffer bytes]}}. The
    buffer is the largest tensor argument (lists summed): the full tensor an all-reduce reduces, an all-gather's
    output, a reduce-scatter's input. The mode is thread-local state that autograd carries into backward."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.counts: dict[str, dict[str, list[int]]] = {"forward": {}, "backward": {}}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(func.overloadpacket)
        if func == SEQUENCE_REDUCED_LINEAR:  # one operator, the reduce-scatter of its (b, s, out) partial sums inside
            x, weight = args[:2]
            self._count("reduce_scatter", x.numel() // x.shape[-1] * weight.shape[0] * x.element_size())
        elif kind is not None:
            self._count(kind, max([_bytes(a) for a in args] + [_bytes(v) for v in (kwargs or {}).values()]))
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, nbytes: int) -> None:
        got = self.counts[self.phase].setdefault(kind, [0, 0])
        got[0] += 1
        got[1] += nbytes

    def calls(self) -> dict[str, dict[str, int]]:
        return {phase: {k: v[0] for k, v in kinds.items()} for phase, kinds in self.counts.items()}


def count_layer(argv: list[str], recompute: str, seq_len: int = 8) -> dict:
    """Rank function: one forward + backward of decoder layer 0 (the model of ``load(argv)``, with its parallel
    settings) under activation checkpointing ``recompute``; this rank's {phase: {kind: [calls, bytes]}}."""
    cfg = load(argv)
    ctx = ParallelContext.from_config(cfg)
    sp, tp = cfg.parallel.sequence_parallel, cfg.parallel.tp
    model = materialize(
        apply_tensor_parallel(model_lib.build(cfg.model), ctx.tp_group, sequence_parallel=sp),
        torch.device("cpu"),
        seed=3,
        std=0.02,
    )
    layer = model.model.layers["0"]
    set_recompute(layer, recompute)
    b, h = cfg.train.micro_batch_size, cfg.model.hidden_size
    local = seq_len // tp if sp else seq_len  # under sp the residual stream is this rank's (b, s/tp, h)
    x = torch.randn(b, local, h, generator=torch.Generator().manual_seed(1 + ctx.tp_rank), requires_grad=True)
    cos, sin = rope_cos_sin(cfg.model, torch.arange(seq_len), x.dtype)  # RoPE covers the whole sequence
    counter = CollectiveCounter()
    with counter:
        out = layer(x, cos, sin)  # (b, s, h), (b, s/tp, h) under sp
        counter.phase = "backward"
        out.sum().backward()
    return counter.counts


def layer_argv(config: str, tp: int, sp: bool, micro_batch_size: int = 2) -> list[str]:
    return [
        "--config",
        config,
        "--model.num_layers",
        "1",
        "--parallel.tp",
        str(tp),
        "--parallel.sequence_parallel",
        str(sp).lower(),
        "--train.micro_batch_size",
        str(micro_batch_size),
        "--train.global_batch_size",
        str(micro_batch_size),
    ]


# Megatron-LM's design per layer: (forward, backward) calls of (all_reduce, all_gather, reduce_scatter).
# Without sp: g's all-reduce after o_proj, down_proj forward, f's in front of qkv, gate_up backward. With sp
# (Korthikanti et al. Sec. 4.2.2, Megatron's LinearWithGradAccumulationAndAsyncCommunication): forward g-bar's
# all-gather in front of qkv, gate_up and g's reduce-scatter after o_proj, down_proj; backward g's all-gather of the
# gradient (2), each column layer's re-gather of its input for the weight gradient (2) and g-bar's reduce-scatter
# (2). Megatron sums the norm weights' gradients over tp in one coalesced all-reduce for all layers after backward
# (finalize_model_grads), not per layer: 0. Full recompute (its reentrant CheckpointFunction) re-runs the whole
# forward in backward, every forward collective included.
DESIGN = {
    (False, "none"): ((2, 0, 0), (2, 0, 0)),
    (False, "full"): ((2, 0, 0), (4, 0, 0)),
    (True, "none"): ((0, 2, 2), (0, 4, 2)),
    (True, "full"): ((0, 2, 2), (0, 6, 4)),
}
# Before the q/k/v and gate/up fusion (separate q, k, v, gate, up linears; counted on commit c38bd66, see
# tests/parallel/tp/test_tp_collectives.py); sequence parallelism came after the fusion.
BEFORE = {(False, "none"): ((2, 0, 0), (5, 0, 0)), (False, "full"): ((2, 0, 0), (6, 0, 0))}


def _calls(triple) -> str:
    return " ".join(map(str, triple))


def _cells(counts: dict, phase: str, tokens: int, tp: int) -> list[str]:
    """Calls of each shown kind; bytes per token of the full buffers and sent per rank (ring)."""
    buf = sum(v[1] for v in counts[phase].values()) / tokens
    ring = sum(v[1] * (2 if k == "all_reduce" else 1) * (tp - 1) / tp for k, v in counts[phase].items()) / tokens
    return [_calls(counts[phase].get(k, [0])[0] for k in SHOWN), f"{buf:.0f}", f"{ring:.0f}"]


def print_collectives(config: str, tps: list[int], micro_batch_size: int, seq_len: int) -> None:
    cfg = load(layer_argv(config, 1, False, micro_batch_size))
    m, tokens = cfg.model, micro_batch_size * seq_len
    print(
        f"\nd) collectives per decoder layer, one forward + backward, counted on the c10d calls; "
        f"{Path(config).name} (h={m.hidden_size}, ffn={m.intermediate_size}, {m.num_heads}/{m.num_kv_heads} "
        f"heads), {micro_batch_size} x {seq_len} tokens, fp32. Calls as 'all_reduce all_gather reduce_scatter'; "
        f"bytes per token of the micro-batch: full buffers (buf) and sent by one rank under ring algorithms (ring); "
        f"Megatron-LM's design and ours before the q/k/v, gate/up fusion as calls"
    )
    print(
        f"{'tp':>3} {'sp':>3} {'recompute':>9} | {'fwd':>5} {'buf B':>6} {'ring B':>6} | {'bwd':>5} {'buf B':>6} "
        f"{'ring B':>6} | {'Megatron':>11} | {'before':>11}"
    )
    for tp in tps:
        for sp in (False, True):
            for recompute in ("none", "full"):
                counts = run_ranks(
                    count_layer,
                    tp,
                    layer_argv(config, tp, sp, micro_batch_size),
                    recompute,
                    seq_len,
                    threads=1,
                    timeout_s=600,
                )
                assert all(c == counts[0] for c in counts), f"tp ranks differ: {counts}"
                f, b = _cells(counts[0], "forward", tokens, tp), _cells(counts[0], "backward", tokens, tp)
                design = "/".join(map(_calls, DESIGN[sp, recompute]))
                before = "/".join(map(_calls, BEFORE[sp, recompute])) if (sp, recompute) in BEFORE else "-"
                print(
                    f"{tp:>3} {'on' if sp else 'off':>3} {recompute:>9} | {f[0]:>5} {f[1]:>6} {f[2]:>6} | "
                    f"{b[0]:>5} {b[1]:>6} {b[2]:>6} | {design:>11} | {before:>11}",
                    flush=True,
                )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny.yaml"))
    p.add_argument("--tp", nargs="*", type=int, default=[2, 4])
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16, help="divisible by every tp")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.pop("MASTER_ADDR", None)
    torch.set_num_threads(1)  # the parent forks ranks: keep it single-threaded (tests/conftest.py says why)
    print_collectives(args.config, args.tp, args.micro_batch_size, args.seq_len)


if __name__ == "__main__":
    main()
