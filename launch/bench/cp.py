"""Benchmark: context parallelism (engine/parallel/cp/), measured beside the planner (engine/planning/).

    python launch/bench/cp.py [--config configs/tiny.yaml] [--seq-lens 128 256 512] [--cp 1 2 4] [--repeats 3]
        [--set section.key=value ...]

For each sequence length, cp size and cp mode (ring, all_to_all; cp 1 once) forked gloo ranks
(engine/parallel/layout/spawn.py) run the model (whole, no pp/tp/dp) on one micro-batch: a forward and backward with the
cp core the trainer applies (engine/parallel/cp/apply.py), fed as the trainer feeds it (cp/inputs.py). Per rank:
- saved: the peak bytes saved for backward (engine/metrics/memory.py SavedActivations) against the planner's
  activations.micro_batch_bytes;
- sent: bytes this rank sends through the cp collectives (the ring's batch_isend_irecv, all_to_all_single: (cp-1)/cp
  of its buffer) in one forward + backward, against engine/planning/cp.py bytes_per_layer x layers; and the ring's
  largest batch of buffers posted at once against ring_wire_bytes;
- time: the median wall time of ``--repeats`` forward + backward passes after one warm-up (the slowest rank).
Figures on CPU gloo: the time compares the two modes on this machine, not a GPU's; the bytes and memory do not
depend on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.config import load  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402

HEADER = ["seq", "cp", "mode", "saved MB", "planned MB", "sent MB", "planned MB", "wire MB", "planned MB", "fwd+bwd ms"]


@contextmanager
def counting_sends(cp: int):
    """Counts what this rank sends through the two collectives the cp cores use, while active: {"sent": bytes,
    "wire": the largest batch of ring sends and receives posted at once}."""
    seen = {"sent": 0.0, "wire": 0.0}
    batch, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch_spy(ops):
        nbytes = [op.tensor.numel() * op.tensor.element_size() for op in ops]
        seen["sent"] += sum(n for op, n in zip(ops, nbytes) if op.op is dist.isend)
        seen["wire"] = max(seen["wire"], sum(nbytes))
        return batch(ops)

    def a2a_spy(out, x, **kw):
        seen["sent"] += x.numel() * x.element_size() * (cp - 1) / cp  # the own block stays
        return a2a(out, x, **kw)

    dist.batch_isend_irecv, dist.all_to_all_single = batch_spy, a2a_spy
    try:
        yield seen
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a


def micro_batch(argv: list[str], repeats: int = 0) -> dict:
    """Rank function: one micro-batch of the model of ``load(argv)`` under its parallel.cp / cp_mode on the WORLD
    group; this rank's measured and planned figures (module docstring), and ``repeats`` timed passes."""
    from engine.metrics.memory import SavedActivations
    from engine.model import transformer as model_lib
    from engine.model.init import materialize
    from engine.parallel.cp.apply import apply_context_parallel
    from engine.parallel.cp.inputs import micro_batch_inputs
    from engine.parallel.tp.layers import vocab_parallel_cross_entropy
    from engine.planning import activations as acts
    from engine.planning import cp as cp_plan

    cfg = load(argv)
    cp, t = cfg.parallel.cp, cfg.train
    model = model_lib.build(cfg.model, device="meta")
    apply_context_parallel(model, cfg.parallel.cp_mode, dist.group.WORLD, cp)
    materialize(model, torch.device("cpu"), seed=0, std=0.02)
    rows = torch.randint(
        0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    eos = 3 if cfg.data.document_mask else None
    inputs, labels, extra = micro_batch_inputs([rows], 1, eos, cp, dist.get_rank(), t.seq_len)

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=t.dtype == "bf16"):
            loss = vocab_parallel_cross_entropy(model(inputs[0], **(extra[0] if extra else {})), labels[0], None)
        loss.backward()

    tracker = SavedActivations(model)
    with counting_sends(cp) as seen, tracker.hooks():
        step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    fwd, bwd = cp_plan.bytes_per_layer(cfg, 1)
    layers = cfg.model.num_layers
    return {
        "saved": tracker.peak,
        "planned_saved": acts.micro_batch_bytes(cfg, 1, 1, 0, layers),
        "sent": seen["sent"],
        "planned_sent": layers * (fwd + bwd),
        "wire": seen["wire"],
        "planned_wire": max(cp_plan.ring_wire_bytes(cfg, 1)),
        "seconds": statistics.median(times) if times else 0.0,
    }


def cases(cps: list[int]) -> list[tuple[int, str]]:
    return [(cp, mode) for cp in cps for mode in (("ring",) if cp == 1 else ("ring", "all_to_all"))]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    base = ["--config", args.config] + [
        x for item in args.set for x in ("--" + item.partition("=")[0], item.partition("=")[2])
    ]
    print(" | ".join(HEADER))
    for seq in args.seq_lens:
        for cp, mode in cases(args.cp):
            run = [*base, "--train.seq_len", str(seq), "--parallel.cp", str(cp), "--parallel.cp_mode", mode]
            got = run_ranks(micro_batch, cp, run, args.repeats, timeout_s=600.0, threads=1)
            r = max(got, key=lambda g: g["saved"])
            mb = [r[k] / 1e6 for k in ("saved", "planned_saved", "sent", "planned_sent", "wire", "planned_wire")]
            print(
                " | ".join(
                    [str(seq), str(cp), mode if cp > 1 else "-"]
                    + [f"{x:.3f}" for x in mb]
                    + [f"{1e3 * max(g['seconds'] for g in got):.1f}"]
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
