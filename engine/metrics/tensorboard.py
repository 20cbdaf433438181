"""Optional copies of each metrics.jsonl record: TensorBoard event files and Weights & Biases.

``log.tensorboard: true`` writes ``<train.out_dir>/tensorboard/events.out.tfevents.*`` with torch's SummaryWriter
(needs the ``tensorboard`` package, in the dev extra); view with ``tensorboard --logdir <out_dir>``.
``log.wandb_project: NAME`` logs the same scalars to W&B (needs ``wandb``); the mode is ``offline`` unless
``WANDB_MODE`` says otherwise, so a run without network works and ``wandb sync`` uploads it later.
Scalars, by the record's keys (engine/metrics/stepstats.py): loss, eval_loss, lr, grad_norm, tokens_per_s, tflops, mfu,
peak_mem_bytes (as memory/peak_GiB), step_time and time/<phase> seconds, the straggler report's worst ratio and
cost (straggler/worst_ratio, straggler/cost); an MoE model's lm_loss, aux and z losses,
tokens per expert (min, max, CV) and dropped tokens. Only the rank that writes metrics.jsonl
(rank 0) makes a sink.
"""

from __future__ import annotations

import importlib.util
import os
import threading

from engine.config import ConfigError

SCALARS = {
    "loss": "loss/train",
    "eval_loss": "loss/eval",
    "lr": "lr",
    "grad_norm": "grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops": "throughput/tflops_per_device",
    "mfu": "throughput/mfu",
    "step_time": "time/step_s",
    "skipped_steps": "skipped_steps",
    # the straggler report (engine/trust/stragglers.py), at logged steps
    "straggler_ratio": "straggler/worst_ratio",
    "straggler_cost": "straggler/cost",
    # mixture of experts (engine/metrics/moe.py)
    "lm_loss": "loss/lm",
    "moe_aux_loss": "moe/aux_loss",
    "moe_z_loss": "moe/z_loss",
    "moe_tokens_per_expert_min": "moe/tokens_per_expert_min",
    "moe_tokens_per_expert_max": "moe/tokens_per_expert_max",
    "moe_tokens_per_expert_cv": "moe/tokens_per_expert_cv",
    "moe_dropped_tokens": "moe/dropped_tokens",
}


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers under their TensorBoard tags (the step itself is the x axis, not a scalar)."""
    out = {tag: float(record[key]) for key, tag in SCALARS.items() if isinstance(record.get(key), (int, float))}
    if isinstance(record.get("peak_mem_bytes"), (int, float)):
        out["memory/peak_GiB"] = record["peak_mem_bytes"] / 2**30
    for phase, seconds in (record.get("time") or {}).items():
        out[f"time/{phase}_s"] = float(seconds)
    return out


def _quiet_writer_thread(hook):
    """tensorboard writes events from a thread of its own; an OSError there (a full disk) is raised again by the
    next flush in the main thread, where engine/metrics/logger.py turns it into one line, so the thread's own
    traceback would be a second, noisier report of it. Every other thread's exception goes to ``hook``."""

    def quiet(args):
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith("tensorboard.")):
            hook(args)

    quiet.quiet_tensorboard = True
    return quiet


class TensorBoardSink:
    def __init__(self, out_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        if not getattr(threading.excepthook, "quiet_tensorboard", False):
            threading.excepthook = _quiet_writer_thread(threading.excepthook)
        self.path = os.path.join(out_dir, "tensorboard")  # named by a failed write (engine/metrics/logger.py)
        self.writer = SummaryWriter(log_dir=self.path)

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a crash must not lose the curve written so far; a full disk raises here (OSError)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, out_dir: str, config: dict):
        import wandb

        self.path = out_dir
        self.run = wandb.init(project=project, dir=out_dir, config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _require(module: str, setting: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{setting} needs the {module} package: pip install {module}"
            + (' (or pip install -e ".[dev]")' if module == "tensorboard" else "")
        )


def build_sinks(cfg, create: bool) -> list:
    """The sinks log.tensorboard and log.wandb_project ask for. Every rank checks that their packages exist (so
    every rank refuses alike); only the metrics-writing rank (``create``) makes them."""
    if cfg.log.tensorboard:
        _require("tensorboard", "log.tensorboard=true")
    if cfg.log.wandb_project:
        _require("wandb", f"log.wandb_project={cfg.log.wandb_project!r}")
    sinks = []
    if create and cfg.log.tensorboard:
        sinks.append(TensorBoardSink(cfg.train.out_dir))
    if create and cfg.log.wandb_project:
        sinks.append(WandbSink(cfg.log.wandb_project, cfg.train.out_dir, cfg.to_dict()))
    return sinks
