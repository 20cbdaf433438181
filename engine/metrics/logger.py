"""Per-step metrics: one JSON object per logged step in <out_dir>/metrics.jsonl, and a progress line on rank 0."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from engine.storage import StorageError, append, describe, say


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes metrics on the rank that owns them (rank 0 by convention); other ranks pass ``enabled=False``.

    A record that cannot be written (disk full, read-only, metrics.jsonl made a directory: engine/storage.py) is
    not a traceback that loses the run: ``on_failure(line)`` is called once (the trainer's stop request: save a
    checkpoint after this step, then exit 3) and nothing more is written; without ``on_failure`` it raises
    StorageError."""

    def __init__(
        self,
        out_dir: str,
        enabled: bool,
        progress: bool,
        total_steps: int,
        sinks: list | None = None,
        on_failure: Callable[[str], None] | None = None,
    ):
        self.enabled, self.progress, self.total_steps = enabled, progress, total_steps
        self.path = Path(out_dir) / "metrics.jsonl"
        self.start_time, self.start_step = time.perf_counter(), None
        self.sinks = sinks or []  # engine/metrics/tensorboard.py: TensorBoard, W&B
        self.on_failure, self.failed = on_failure, None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _fail(self, path: Path, e: BaseException) -> None:
        self.failed = f"metrics: {describe(path, e)}"
        sinks, self.sinks = self.sinks, []
        for sink in sinks:  # their files may be on the same full disk: closing is best effort
            try:
                sink.close()
            except Exception:
                pass
        if self.on_failure is None:
            raise StorageError(self.failed)
        self.on_failure(self.failed)

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
        tmp = self.path.with_name("metrics.jsonl.tmp")
        try:
            with self.path.with_name("metrics.rolled_back.jsonl").open("ab") as f:
                f.writelines(dropped)
            tmp.write_bytes(b"".join(keep))
            tmp.replace(self.path)
        except OSError as e:  # before the first step: nothing to save yet, the run is refused (exit 3)
            raise StorageError(f"metrics: {describe(self.path, e)}") from None
        bad = f" and {unreadable} unreadable lines" if unreadable else ""
        print(
            f"metrics: {len(dropped) - unreadable} records past step {step}{bad} moved to metrics.rolled_back.jsonl",
            flush=True,
        )

    def log(self, record: dict) -> None:
        """Append ``record`` (which must hold 'step') and print the progress line with an ETA."""
        if not self.enabled or self.failed:
            return
        try:
            append(self.path, (json.dumps(record) + "\n").encode())
        except OSError as e:
            return self._fail(self.path, e)
        for sink in self.sinks:
            try:
                sink.log(record)
            except OSError as e:
                return self._fail(getattr(sink, "path", self.path.parent), e)
        if self.progress:
            self._print_progress(record)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()  # TensorBoard's last flush
            except OSError as e:
                raise StorageError(f"metrics: {describe(getattr(sink, 'path', self.path.parent), e)}") from None

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
        say(
            f"step {step:>6}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | "
            f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{1000 * r['step_time']:.0f} ms/step | ETA {eta}"
        )
