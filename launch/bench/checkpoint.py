"""Checkpoint save and load time and size, per config and number of ranks (forked gloo ranks on this machine).

    python launch/bench/checkpoint.py [--config configs/tiny.yaml --config configs/50m.yaml] [--world 1 2 4]
                                      [--dp-mode ddp fsdp zero2] [--repeat 3] [--dir /tmp/bench_ckpt]
                                      [--verify true false]

Each case builds the model with dp = world size (one torch thread per rank), takes one optimizer step (so Adam's
moments exist; a small batch: the size of a checkpoint does not depend on it), then measures, on the slowest rank:
  save     a synchronous save (snapshot to CPU, write every rank's shard, CRCs, commit: index, rename, latest);
  async    the same with checkpoint.async_save: ``async blocked`` is the time save() holds the training loop (the
           snapshot), ``3 steps + async save`` the time of three training steps run while the writer thread works
           plus the wait for its commit, to compare with ``3 steps`` alone and ``save``;
  load     resume into a fresh Trainer: validation (sizes, every shard's CRC) and reading the pieces;
  size     bytes on disk (fp32 weights + 2 Adam moments, written once whatever the number of replicas);
  check    checkpoint.verify's part of the save and of the load (engine/trust/saved.py: the probe batch's forward
           and the digests of the state, in the writer thread of an async save; included in ``save``, not in
           ``load``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.config import load  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.trainer import Trainer  # noqa: E402

MODES = {f"zero{k}": ["--parallel.dp_mode", "zero", "--parallel.zero_stage", str(k)] for k in (1, 2, 3)}


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def bench_rank(argv: list[str], root: str) -> dict:
    cfg = load([*argv, "--checkpoint.dir", root, "--checkpoint.resume", "none", "--checkpoint.keep", "0"])
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    ckpt = trainer.checkpointer

    def steps(n: int = 3) -> None:
        for _ in range(n):
            trainer.train_step(trainer.next_local_batch())

    steps(1)
    out = {"save": timed(lambda: ckpt.save(trainer.parts, trainer.position))}
    out["save check"] = ckpt.timings.get("probe_s", 0.0) + ckpt.timings.get("digest_s", 0.0)
    out["3 steps"] = timed(steps)
    path = ckpt.root / f"step_{trainer.step - 3:06d}"
    out["size_mb"] = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    cfg.checkpoint.async_save = True

    def async_save_while_training() -> None:
        out["async blocked"] = timed(lambda: ckpt.save(trainer.parts, trainer.position))
        steps()
        ckpt.wait()

    out["3 steps + async save"] = timed(async_save_while_training)
    resume = load([*argv, "--checkpoint.resume", str(path)])
    fresh = Trainer(resume, trainer.ctx)
    out["load"] = fresh.checkpointer.timings["load_s"]
    out["load check"] = fresh.checkpointer.timings.get("verify_s", 0.0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", help="config files (default: tiny and 50m)")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--dp-mode",
        nargs="+",
        default=["ddp", "fsdp"],
        choices=["ddp", "fsdp", *MODES],
        help="zero1/zero2/zero3: dp_mode zero at that stage",
    )
    p.add_argument("--dir", default="/tmp/bench_ckpt")
    p.add_argument("--verify", nargs="+", default=["true"], choices=["true", "false"], help="checkpoint.verify")
    p.add_argument("--repeat", type=int, default=1, help="runs per case; the fastest is printed (a shared machine)")
    args = p.parse_args()
    # One thread per rank at every world size (ParallelContext would give a lone rank all the cores), so that the
    # writer thread of an async save has a core and oversubscribed OpenMP threads do not distort the timings.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configs = args.config or ["configs/tiny.yaml", "configs/50m.yaml"]
    keys = ["size_mb", "save", "save check", "async blocked", "3 steps", "3 steps + async save", "load", "load check"]
    print(
        f"torch {torch.__version__}, one thread per rank; times in seconds (slowest rank, fastest of "
        f"{args.repeat} runs)"
    )
    print("| config | ranks | dp_mode | verify | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 4) + "|")
    for config in configs:
        for world in args.world:
            for mode, verify in itertools.product(args.dp_mode if world > 1 else ["ddp"], args.verify):
                dp_mode = MODES.get(mode, ["--parallel.dp_mode", mode])
                argv = [
                    "--config",
                    config,
                    *dp_mode,
                    "--train.global_batch_size",
                    str(world),
                    "--train.micro_batch_size",
                    "1",
                    "--train.seq_len",
                    "32",
                    "--log.progress",
                    "false",
                    "--train.out_dir",
                    f"{args.dir}/out",
                    "--checkpoint.verify",
                    verify,
                ]
                rows = []
                for _ in range(args.repeat):
                    shutil.rmtree(args.dir, ignore_errors=True)
                    results = run_ranks(bench_rank, world, argv, args.dir, timeout_s=1800, threads=1)
                    rows.append({k: max(r[k] for r in results) for k in keys})
                row = {k: min(r[k] for r in rows) for k in keys}
                print(
                    f"| {Path(config).stem} | {world} | {mode} | {verify} | "
                    + " | ".join(f"{row[k]:.2f}" if k != "size_mb" else f"{row[k]:.1f} MB" for k in keys)
                    + " |",
                    flush=True,
                )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
