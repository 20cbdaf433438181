"""Initialisation time of one weight: the former full draw on the CPU then a tp slice, against drawing only the
tiles that overlap the slice (engine/model/init.py draw_box), then copying to the target device.

    python launch/bench/init.py [--rows 8192 --cols 2048] [--tp 1 8] [--device cpu|cuda] [--repeat 3]

Prints seconds per weight and ns per element of the whole tensor, and the estimate for a Llama-3.2-1B-shaped model
(1.24e9 parameters, all drawn but the norms) at that rate: every rank paid the full draw before; now a rank pays
its 1/tp slice. The former draw is reproduced here (torch.Generator().manual_seed, normal_ on the CPU, chunk, copy
to the device) as it was in engine/model/init.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402

from engine.model.init import draw_box  # noqa: E402

LLAMA_1B_PARAMS = 1.236e9  # h 2048, ffn 8192, 16 layers, vocab 128256, tied: the drawn tensors' elements


def full_draw(rows: int, cols: int, tp: int, device: torch.device) -> torch.Tensor:
    """The former way: the whole tensor from a seeded CPU generator, then rank 0's row slice, copied over."""
    gen = torch.Generator().manual_seed(1234)
    full = torch.empty(rows, cols).normal_(0.0, 0.02, generator=gen)
    return full.chunk(tp, dim=0)[0].to(device)


def slice_only(rows: int, cols: int, tp: int, device: torch.device) -> torch.Tensor:
    return draw_box(1234, torch.Size([rows, cols]), (0, 0), (rows // tp, cols), 0.02).to(device)


def best_of(fn, repeat: int, device: torch.device) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    n = args.rows * args.cols
    print(f"weight ({args.rows}, {args.cols}) on {device}, {torch.get_num_threads()} threads; best of {args.repeat}")
    print(f"{'method':<28}{'tp':>4}{'s':>10}{'ns/elem(whole)':>16}{'1B model, s':>14}")
    for tp in args.tp:
        for name, fn in (("full CPU draw + slice", full_draw), ("tiles of the slice only", slice_only)):
            s = best_of(lambda: fn(args.rows, args.cols, tp, device), args.repeat, device)
            print(f"{name:<28}{tp:>4}{s:>10.3f}{s / n * 1e9:>16.2f}{s / n * LLAMA_1B_PARAMS:>14.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
