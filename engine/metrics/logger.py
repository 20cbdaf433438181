"""Per-step metrics: one JSON object per logged step in <out_dir>/metrics.jsonl, and a progress line on rank 0."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes metrics on the rank that owns them (rank 0 by convention); other ranks pass ``enabled=False``."""

    def __init__(self, out_dir: str, enabled: bool, progress: bool, total_steps: int, sinks: list | None = None):
        self.enabled, self.progress, self.total_steps = enabled, progress, total_steps
        self.path = Path(out_dir) / "metrics.jsonl"
        self.start_time, self.start_step = time.perf_counter(), None
        self.sinks = sinks or []  # engine/metrics/tensorboard.py: TensorBoard, W&B
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def rewind(self, step: int) -> None:
        """Start (or resume) at ``step``: records past it belong to a run that was rolled back (a crash after the
        checkpoint it resumes from, or an earlier run); they move to metrics.rolled_back.jsonl so each step is in
        metrics.jsonl once and nothing is lost. Lines that are not a JSON record (cut short by a crash, a byte that
        is not UTF-8) move there too, byte for byte, with a count."""
        if not self.enabled or not self.path.is_file():
            return
        keep, dropped, unreadable = [], [], 0
        for line in self.path.read_bytes().splitlines(keepends=True):
            try:
                past = json.loads(line)["step"] > step  # json.loads decodes bytes as UTF-8 (a ValueError if not)
            except (ValueError, KeyError, TypeError):
                past, unreadable = True, unreadable + 1
            (dropped if past else keep).append(line if line.endswith(b"\n") else line + b"\n")
        if not dropped:
            return
        with self.path.with_name("metrics.rolled_back.jsonl").open("ab") as f:
            f.writelines(dropped)
        tmp = self.path.with_name("metrics.jsonl.tmp")
        tmp.write_bytes(b"".join(keep))
        tmp.replace(self.path)
        bad = f" and {unreadable} unreadable lines" if unreadable else ""
        print(f"metrics: {len(dropped) - unreadable} records past step {step}{bad} moved to "
              f"metrics.rolled_back.jsonl", flush=True)

    def log(self, record: dict) -> None:
        """Append ``record`` (which must hold 'step') and print the progress line with an ETA."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(record)
        if self.progress:
            self._print_progress(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def _print_progress(self, r: dict) -> None:
        """The ETA is the mean wall time per step since the first logged step after warm-up (a ``warmup`` record,
        engine/metrics/stepstats.py: compilation and first touch), times the steps left."""
        step = r["step"]
        if r.get("warmup"):
            eta = "after warm-up"
        else:
            if self.start_step is None:
                self.start_step, self.start_time = step - 1, time.perf_counter() - r.get("step_time", 0.0)
            per_step = (time.perf_counter() - self.start_time) / max(1, step - self.start_step)
            eta = _fmt_duration(per_step * (self.total_steps - step))
        print(f"step {step:>6}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | "
              f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
              f"{1000 * r['step_time']:.0f} ms/step | ETA {eta}", file=sys.stdout, flush=True)
