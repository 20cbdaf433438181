"""One case of launch/gpu_check.py, run in its own process so that a CUDA failure (an illegal access, an OOM, a
compiler crash) ends this case only and the report goes on.

    python launch/bench/gpu_case.py SPEC.json RESULT.json

SPEC: {"kind": "smoke" | "memory", "device": "cuda" | "cpu", "argv": [config arguments], "steps": N}.
- smoke: N optimizer steps of the engine's Trainer (one rank) on the bundled corpus; RESULT {"losses": [...]}.
- memory: two steps (AdamW's state exists), then one step measured by launch/bench/measure.py's measure_step (the
  bytes of tensors: params, grads, optimizer, activations, peak) and, on CUDA, by the allocator
  (``torch.cuda.max_memory_allocated`` over that step, after ``reset_peak_memory_stats``); random token batches.
TF32 is switched off in this process (``--train.tf32 false``, which the engine applies when it builds the context,
and ``torch.backends.cudnn.allow_tf32 = False``): an fp32 CUDA loss is compared with a CPU loss, and TF32's 10-bit
mantissa would dominate that difference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def trainer_on(device: str, argv: list[str]):
    """The engine's Trainer of ``argv`` on one rank of ``device`` (backend nccl for cuda, gloo for cpu: the one
    place that maps them to devices is engine/parallel/layout/context.py)."""
    from engine.config import load
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    os.environ.pop("MASTER_ADDR", None)  # one rank: an in-memory store, no rendezvous
    cfg = load(
        [
            *argv,
            "--parallel.backend",
            "nccl" if device == "cuda" else "gloo",
            "--log.progress",
            "false",
            "--train.tf32",
            "false",
        ]
    )  # train.tf32 defaults to true on CUDA: it would override main()'s flag
    return Trainer(cfg, ParallelContext.from_config(cfg))


def smoke(spec: dict) -> dict:
    trainer = trainer_on(spec["device"], spec["argv"])
    losses = [trainer.train_step(trainer.next_local_batch())["loss"] for _ in range(spec["steps"])]
    return {"losses": losses, "device": str(trainer.ctx.device)}


def memory(spec: dict) -> dict:
    from launch.bench.measure import measure_step

    trainer = trainer_on(spec["device"], spec["argv"])
    t, device = trainer.cfg.train, trainer.ctx.device
    gen = torch.Generator().manual_seed(0)

    def batch() -> torch.Tensor:  # (B, s+1) random token ids: the corpus need not hold seq_len * B tokens
        return torch.randint(0, trainer.cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=gen)

    for _ in range(2):  # AdamW creates its state in the first step
        trainer.train_step(batch())
    result = {"device": str(device)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    result.update(measure_step(trainer, batch()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return result


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.backends.cudnn.allow_tf32 = False  # the matmul flag is the engine's train.tf32 (trainer_on)
    start = time.perf_counter()
    result = {"smoke": smoke, "memory": memory}[spec["kind"]](spec)
    result["seconds"] = time.perf_counter() - start
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(result_path)  # a case killed mid-write leaves no half-written result


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (process groups, compile workers): the result is written
