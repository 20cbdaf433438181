"""Benchmark: peak memory and time of the loss (forward + backward) at tp = 1, against F.cross_entropy, side by side.

    python launch/bench/loss.py [--vocab 32768] [--tokens 4096] [--dtype bf16] [--repeats 3] [--threads 1]

"before" is the engine's loss as it was at tp = 1, ``F.cross_entropy(logits.float(), target)`` (the tp > 1 path
also kept an fp32 softmax of the whole local logits); "after" is engine.parallel.tp.cross_entropy's chunked loss.
Memory is the peak of the storages the loss allocates, counted by engine.metrics.memory.LiveTensorBytes (works on
CPU; the logits themselves are allocated before and not counted). Runs alternate (before, after, before, ...);
the times are medians, wall and this process' CPU seconds (the CPU time holds on a loaded machine), and "x before"
is each one's ratio to F.cross_entropy's from the same run. Both give the same loss and gradient
(tests/parallel/tp/test_cross_entropy.py). The peer benchmark's shape (configs/tiny.yaml, one micro-batch):
``--vocab 4096 --tokens 512 --dtype fp32``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.metrics.memory import LiveTensorBytes  # noqa: E402
from engine.parallel.tp.cross_entropy import CHUNK_ELEMENTS, vocab_parallel_cross_entropy  # noqa: E402


def before(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def after(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, target, None)


def run(loss_fn, logits: torch.Tensor, target: torch.Tensor, count: bool) -> tuple[int, float, float, float]:
    """(peak bytes allocated by forward + backward, or 0 when not ``count``ed, wall seconds, CPU seconds, loss
    value) of one run (a run that counts memory is not timed: the counting slows it)."""
    logits.grad = None
    start, cpu = time.perf_counter(), time.process_time()
    with LiveTensorBytes() if count else contextlib.nullcontext() as live:
        loss = loss_fn(logits, target)
        loss.backward()
    return live.peak if count else 0, time.perf_counter() - start, time.process_time() - cpu, loss.item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: as the peer benchmark)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    results = {"before": [], "after": []}
    peaks = {name: run(fn, logits, target, count=True)[0] for name, fn in (("before", before), ("after", after))}
    for _ in range(args.repeats):
        for name, fn in (("before", before), ("after", after)):
            results[name].append(run(fn, logits, target, count=False))
    mib = 2**20
    logit_mib = logits.numel() * logits.element_size() / mib
    print(
        f"loss forward+backward: {args.tokens} tokens x vocab {args.vocab}, {args.dtype} logits "
        f"({logit_mib:.0f} MiB), chunk {max(1, CHUNK_ELEMENTS // args.vocab)} tokens, torch {torch.__version__}"
    )
    heads = ("peak MiB", "x logits", "wall s", "x before", "CPU s", "x before")
    print(f"{'':8}" + "".join(f"{h:>10}" for h in heads) + f"{'loss':>12}")
    wall, cpu = ({k: statistics.median(r[i] for r in runs) for k, runs in results.items()} for i in (1, 2))
    for name, runs in results.items():
        print(
            f"{name:8}{peaks[name] / mib:>10.1f}{peaks[name] / mib / logit_mib:>10.2f}{wall[name]:>10.4f}"
            f"{wall[name] / wall['before']:>10.2f}{cpu[name]:>10.4f}{cpu[name] / cpu['before']:>10.2f}"
            f"{runs[-1][3]:>12.6f}"
        )


if __name__ == "__main__":
    main()
