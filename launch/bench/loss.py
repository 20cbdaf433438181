"""Benchmark: peak memory and time of the loss (forward + backward), before and after chunking, side by side.

    python launch/bench/loss.py [--vocab 32768] [--tokens 4096] [--dtype bf16] [--repeats 3]

"before" is the engine's loss as it was at tp = 1, ``F.cross_entropy(logits.float(), target)`` (the tp > 1 path
also kept an fp32 softmax of the whole local logits); "after" is engine.parallel.tp.cross_entropy's chunked loss.
Memory is the peak of the storages the loss allocates, counted by engine.metrics.memory.LiveTensorBytes (works on
CPU; the logits themselves are allocated before and not counted). Runs alternate (before, after, before, ...);
the times are medians. Both give the same loss and gradient (tests/parallel/tp/test_cross_entropy.py).
"""

from __future__ import annotations

import argparse
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


def run(loss_fn, logits: torch.Tensor, target: torch.Tensor) -> tuple[int, float, float]:
    """(peak bytes allocated by forward + backward, seconds, loss value) of one run."""
    logits.grad = None
    start = time.perf_counter()
    with LiveTensorBytes() as live:
        loss = loss_fn(logits, target)
        loss.backward()
    return live.peak, time.perf_counter() - start, loss.item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    results = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name, fn in (("before", before), ("after", after)):
            results[name].append(run(fn, logits, target))
    mib = 2**20
    logit_mib = logits.numel() * logits.element_size() / mib
    print(
        f"loss forward+backward: {args.tokens} tokens x vocab {args.vocab}, {args.dtype} logits "
        f"({logit_mib:.0f} MiB), chunk {max(1, CHUNK_ELEMENTS // args.vocab)} tokens, torch {torch.__version__}"
    )
    print(f"{'':8}{'peak MiB':>10}{'x logits':>10}{'median s':>10}{'loss':>12}")
    for name, runs in results.items():
        peak = max(r[0] for r in runs)
        print(
            f"{name:8}{peak / mib:>10.1f}{peak / mib / logit_mib:>10.2f}"
            f"{statistics.median(r[1] for r in runs):>10.3f}{runs[-1][2]:>12.6f}"
        )


if __name__ == "__main__":
    main()
