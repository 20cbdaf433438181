"""The goodput ledger: ``<out_dir>/goodput.json``, kept across restarts and resumes, says where the run's wall time
went: productive steps, start-up, checkpoint saves, steps re-done after a restart (the steps a start had trained
past the checkpoint the next one resumed from) and time lost to a fault (from a start's last record to the next
start, when it did not end by finishing or by a stop). Rank 0 keeps it and prints one line at start and at the end.

Each start is one entry: its wall-clock start, its first and last step, seconds in start-up, steps and saves, when
it last wrote, and how it ended (``done``, ``stopped``, or null: it is running or it failed). The file is replaced
whole (a temporary file, then a rename) every ``log.every`` steps, after each save and at the end, so a kill
leaves the last complete ledger; a write that fails is said once and the ledger is dropped for this start (a full
disk stops the run where metrics.jsonl is written, which saves a checkpoint first).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from engine.storage import describe, say

NAME = "goodput.json"


class Goodput:
    """Rank 0's ledger of this start (no-op on other ranks). ``started``: time.time() when the process began."""

    def __init__(self, out_dir: str, enabled: bool, first_step: int, started: float):
        self.path, self.enabled = Path(out_dir) / NAME, enabled
        self.entries = read(self.path) if enabled else []
        self.me = {"start": started, "first_step": first_step, "last_step": first_step, "startup_s": 0.0}
        self.me |= {"steps_s": 0.0, "saves_s": 0.0, "updated": started, "ended": None}
        self.entries.append(self.me)

    def begin(self) -> None:
        """The first step begins: start-up ends. Prints the ledger so far (earlier starts)."""
        self.me["startup_s"] = time.time() - self.me["start"]
        if len(self.entries) > 1 and self.enabled:
            say(f"{summary(self.entries[:-1], self.me)} so far")
        self.write()

    def step(self, step: int, seconds: float, write: bool) -> None:
        self.me["last_step"], self.me["steps_s"] = step, self.me["steps_s"] + seconds
        if write:
            self.write()

    def saved(self, seconds: float) -> None:
        self.me["saves_s"] += seconds
        self.write()

    def end(self, how: str) -> None:
        """The run ends by finishing (``done``) or on a stop signal (``stopped``): prints the whole ledger."""
        self.me["ended"] = how
        self.write()
        if self.enabled:
            say(summary(self.entries))

    def write(self) -> None:
        if not self.enabled:
            return
        self.me["updated"] = time.time()
        tmp = self.path.with_name(f"{NAME}.tmp")
        try:
            tmp.write_text(json.dumps({"starts": self.entries}, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:  # a report, not state: the run goes on (a full disk stops it at metrics.jsonl)
            self.enabled = False
            say(f"goodput: {describe(tmp, e)}; the ledger is no longer kept in this start")


def read(path: Path) -> list[dict]:
    """The earlier starts' entries; a missing or unreadable ledger starts a new one (it is a report, not state)."""
    try:
        starts = json.loads(path.read_text())["starts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [s for s in starts if isinstance(s, dict)]


def totals(entries: list[dict], now: dict | None = None) -> dict:
    """Seconds per kind over the starts (``now``: the running start, whose first step says what the last one
    re-does), the restarts counted and the steps re-done."""
    t = {"productive": 0.0, "startup": 0.0, "saves": 0.0, "redone": 0.0, "lost": 0.0, "other": 0.0}
    t |= {"restarts": 0, "redone_steps": 0}
    following = entries[1:] + ([now] if now is not None else [])
    for entry, nxt in zip(entries, following + [None]):
        wall = max(0.0, entry["updated"] - entry["start"])
        steps = max(0, entry["last_step"] - entry["first_step"])
        redo = 0 if nxt is None else max(0, min(steps, entry["last_step"] - nxt["first_step"]))
        redone_s = entry["steps_s"] * redo / steps if steps else 0.0
        t["productive"] += entry["steps_s"] - redone_s
        t["redone"], t["redone_steps"] = t["redone"] + redone_s, t["redone_steps"] + redo
        t["startup"], t["saves"] = t["startup"] + entry["startup_s"], t["saves"] + entry["saves_s"]
        t["other"] += max(0.0, wall - entry["startup_s"] - entry["steps_s"] - entry["saves_s"])
        if nxt is not None and entry["ended"] is None:  # it failed: from its last record to the next start
            t["lost"], t["restarts"] = t["lost"] + max(0.0, nxt["start"] - entry["updated"]), t["restarts"] + 1
    return t


def summary(entries: list[dict], now: dict | None = None) -> str:
    """'goodput 91.4% over 3 starts: lost 6.0 min to 2 restarts, 4.0 min re-doing 40 steps, 3.0 min saving, ...'"""
    t = totals(entries, now)
    wall = sum(t[k] for k in ("productive", "startup", "saves", "redone", "lost", "other"))
    share = 100.0 * t["productive"] / wall if wall > 0 else 100.0
    n = len(entries)
    return (
        f"goodput {share:.1f}% over {n} start{'s' if n != 1 else ''}: lost {minutes(t['lost'])} to "
        f"{t['restarts']} restart{'s' if t['restarts'] != 1 else ''}, {minutes(t['redone'])} re-doing "
        f"{t['redone_steps']} step{'s' if t['redone_steps'] != 1 else ''}, {minutes(t['saves'])} saving, "
        f"{minutes(t['startup'])} starting, {minutes(t['other'])} in evaluation and logging "
        f"({minutes(t['productive'])} training; {NAME})"
    )


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"
