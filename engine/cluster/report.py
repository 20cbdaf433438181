"""The one ``error:`` line of a refused run, printed exactly once per host however the ranks race.

Under ``torchrun`` or the ``deepspeed`` launcher every rank reaches the same refusal (a bad config, a missing
file) at its own time. Printing on rank 0 only loses the line whenever another rank exits first: the launcher
then kills rank 0 before it prints (seen in 2 of 3 tries with ``--nproc-per-node 2``). Printing on every rank
repeats it N times. So the first rank of a host to fail claims a marker file (``O_EXCL``), prints, and marks it
done; the others wait for that (bounded) and exit silently, so none of them exits before the line is out.
The marker's name holds the launcher's pid and start time (all local workers share that parent) and the restart
round, so another job or a restarted round never finds a stale one.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

WAIT_S = 5.0  # how long a rank that lost the claim waits for the winner's line before exiting anyway


def _launch_id() -> str:
    """Launcher process id, its start time (clock ticks since boot, /proc) and the torchrun restart round."""
    ppid = os.getppid()
    try:
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return f"{ppid}-{started}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def report_once(line: str, wait_s: float = WAIT_S) -> None:
    """Print ``line`` on stderr once per host for the ranks of one launch (directly when there is one rank); a rank
    that lost the claim waits ``wait_s`` at most for the winner's line."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        _print(line)
        return
    marker = Path(tempfile.gettempdir()) / f"engine-error-{_launch_id()}"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another rank of this host prints it; do not exit (and get it killed) before
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if marker.read_text() == "done":
                    return
            except OSError:
                pass
            time.sleep(0.02)
        _print(line)  # the winner died before printing: better twice than never
        return
    except OSError:  # no usable temp dir: better N times than never
        _print(line)
        return
    _print(line)
    os.write(fd, b"done")
    os.close(fd)
