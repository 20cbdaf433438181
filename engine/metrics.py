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

    def __init__(self, out_dir: str, enabled: bool, progress: bool, total_steps: int):
        self.enabled, self.progress, self.total_steps = enabled, progress, total_steps
        self.path = Path(out_dir) / "metrics.jsonl"
        self.start_time, self.start_step = time.perf_counter(), None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict) -> None:
        """Append ``record`` (which must hold 'step') and print the progress line with an ETA."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.progress:
            self._print_progress(record)

    def _print_progress(self, r: dict) -> None:
        step = r["step"]
        if self.start_step is None:
            self.start_step, self.start_time = step - 1, time.perf_counter() - r.get("step_time", 0.0)
        done = step - self.start_step
        per_step = (time.perf_counter() - self.start_time) / max(1, done)
        eta = _fmt_duration(per_step * (self.total_steps - step))
        print(f"step {step:>6}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | "
              f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
              f"{1000 * r['step_time']:.0f} ms/step | ETA {eta}", file=sys.stdout, flush=True)
