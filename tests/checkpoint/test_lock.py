"""The lock of a checkpoint or out folder (engine/checkpoint/lock.py) through its own functions, on real files in
tmp_path: one job per folder (a live holder, also one forked beside it, refuses the next), a dead job's lock taken
over (on this host at once; from an earlier restart round of the same torchrun job at once, on any host), the
holder's refresh outliving a file-system hiccup, and the lines that name a holder. The launcher's view of the same
refusals is tests/launch/test_launch_errors.py; a lock from another host going stale, tests/cluster/test_faults.py."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import socket
import time
from pathlib import Path

import pytest

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.lock import LOCK, CheckpointLock

HOST = socket.gethostname()


def _write_lock(directory: Path, **fields) -> Path:
    """A LOCK as another job writes it (host elsewhere, pid 4242, run old, written just now) with ``fields``."""
    path = directory / LOCK
    path.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": time.time(), "run": "old"} | fields))
    return path


def _torchrun(monkeypatch, run_id: str, restart: str) -> None:
    """This process as a torchrun worker: the variables torchrun's agent sets for its workers."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)


def test_lock_of_an_earlier_restart_round_is_taken_over_at_once(tmp_path, monkeypatch):
    """An elastic restart after the lock holder's host left: the lock of round 1 of this torchrun job, written
    moments ago on another host, is this job's own dead worker's and is taken over without waiting STALE_S."""
    _torchrun(monkeypatch, "job7", "2")
    _write_lock(tmp_path, elastic=["job7", 1])
    lock = CheckpointLock(tmp_path, "new")
    message = lock.acquire()
    assert re.fullmatch(
        r"checkpoint.dir: taking over the lock of pid 4242 on host elsewhere \(run old, since .*\), "
        r"from restart round 1 of this torchrun job",
        message or "",
    ), message
    assert json.loads((tmp_path / LOCK).read_text())["elastic"] == ["job7", 2]
    lock.release()


@pytest.mark.parametrize(
    "theirs,mine",
    [
        (["job7", 2], ("job7", "2")),  # this very round: a live worker of this job, not a dead one
        (["job7", 3], ("job7", "2")),  # a later round
        (["other", 1], ("job7", "2")),  # another torchrun job's earlier round
        (["job7", "1"], ("job7", "2")),  # a round that is not a number
        (["job7"], ("job7", "2")),
        (None, ("job7", "2")),
        (["none", 0], ("none", "1")),  # torchrun's default id, which unrelated jobs share
        (["job7", 1], ("", "2")),
    ],
)
def test_fresh_lock_of_another_job_or_round_on_another_host_is_refused(tmp_path, monkeypatch, theirs, mine):
    """Only an earlier round of this same torchrun job is taken over at once; any other fresh lock from another
    host is a live job's, and the second job is refused naming it (two jobs would write one folder)."""
    _torchrun(monkeypatch, *mine)
    _write_lock(tmp_path, elastic=theirs)
    with pytest.raises(CheckpointError, match="is in use by pid 4242 on host elsewhere"):
        CheckpointLock(tmp_path, "new").acquire()
    assert json.loads((tmp_path / LOCK).read_text())["run"] == "old"


@pytest.mark.parametrize("started", [0, -5, None, "yesterday"])
def test_holder_without_a_start_time_is_named_since_an_unknown_time(tmp_path, live_pid, started):
    """A lock whose start time is missing, not positive or not a number (hand-written, another version's) is
    refused naming 'an unknown time', not 1970 or a traceback."""
    _write_lock(tmp_path, host=HOST, pid=live_pid, started=started)
    with pytest.raises(CheckpointError) as refused:
        CheckpointLock(tmp_path, "new").acquire()
    assert f"is in use by pid {live_pid} on host {HOST} (run old, since an unknown time)" in str(refused.value)


def test_holder_with_a_start_time_is_named_since_then(tmp_path, live_pid):
    _write_lock(tmp_path, host=HOST, pid=live_pid, started=1.7e9)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1.7e9))
    with pytest.raises(CheckpointError, match=re.escape(f"(run old, since {since}); use another checkpoint.dir")):
        CheckpointLock(tmp_path, "new").acquire()


def _hold(root: Path, rounds: int, barrier, results) -> None:
    """A forked job's rank 0, ``rounds`` times: takes the lock of ``root/<round>`` together with its rivals (the
    barrier), keeping each it got; says what each round gave it ("held" or its refusal), then lives until killed."""
    said = []
    for attempt in range(rounds):
        (root / str(attempt)).mkdir(exist_ok=True)
        barrier.wait()
        try:
            CheckpointLock(root / str(attempt), f"job{os.getpid()}").acquire()
            said.append("held")
        except CheckpointError as e:
            said.append(str(e))
    results.put((os.getpid(), said))
    time.sleep(60)


def test_of_jobs_started_together_on_one_folder_one_holds_it(tmp_path):
    """Jobs starting at once on one folder (forked beside each other: rivals, none another's parent): exactly one
    takes the lock, every other is refused naming it. A lock read while its writer was between creating and filling
    it was taken for a dead writer's garbage and taken over: two or more of four held it in up to a third of the
    tries, so the jobs meet on many folders."""
    ctx = multiprocessing.get_context("fork")
    jobs, rounds = 4, 40
    barrier, results = ctx.Barrier(jobs), ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(tmp_path, rounds, barrier, results), daemon=True) for _ in range(jobs)]
    for proc in procs:
        proc.start()
    try:
        said = dict(results.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    for attempt in range(rounds):
        holders = [pid for pid in said if said[pid][attempt] == "held"]
        assert len(holders) == 1, (attempt, {pid: said[pid][attempt] for pid in said})
        assert json.loads((tmp_path / str(attempt) / LOCK).read_text())["pid"] == holders[0]
        refused = [said[pid][attempt] for pid in said if pid != holders[0]]
        assert all(f"is in use by pid {holders[0]} on host {HOST}" in what for what in refused), refused


def test_the_lock_file_is_readable_by_other_users(tmp_path):
    """Another user's job on a shared folder must read the lock: one it cannot read is taken for a garbage lock
    of a dead job and taken over."""
    umask = os.umask(0)
    os.umask(umask)
    lock = CheckpointLock(tmp_path, "mine")
    lock.acquire()
    assert (tmp_path / LOCK).stat().st_mode & 0o777 == 0o644 & ~umask
    lock.release()


def _link_fails(code: int):
    def link(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return link


def test_on_a_file_system_without_hard_links_the_lock_is_created_in_place(tmp_path, monkeypatch):
    """Some file systems (FAT, some FUSE mounts) refuse link(2): the lock is then created in place with O_EXCL and
    a rival's lock still refuses; any other error of link (EIO) is the disk's, raised for the start-up line."""
    monkeypatch.setattr(os, "link", _link_fails(errno.EPERM))
    lock = CheckpointLock(tmp_path, "mine")
    assert lock.acquire() is None
    assert json.loads((tmp_path / LOCK).read_text())["run"] == "mine"
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]  # the record written beside it is gone
    lock.release()
    _write_lock(tmp_path)
    with pytest.raises(CheckpointError, match="is in use by pid 4242 on host elsewhere"):
        CheckpointLock(tmp_path, "new").acquire()
    (tmp_path / LOCK).unlink()
    monkeypatch.setattr(os, "link", _link_fails(errno.EIO))
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        CheckpointLock(tmp_path, "new").acquire()
    assert list(tmp_path.iterdir()) == []
