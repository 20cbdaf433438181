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
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.lock import CLAIM_S, LOCK, STALE_S, CheckpointLock, claim_run_directories, refuse_a_step
from engine.config import load

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


@pytest.mark.parametrize("started", [1, 1.7e9])
def test_holder_with_a_start_time_is_named_since_then(tmp_path, live_pid, started):
    _write_lock(tmp_path, host=HOST, pid=live_pid, started=started)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
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
        except (CheckpointError, OSError) as e:  # OSError: a rival's move taken for a disk error
            said.append(f"{type(e).__name__}: {e}")
    results.put((os.getpid(), said))
    time.sleep(60)


@pytest.mark.parametrize("before", ["nothing", "a dead job's lock"])
def test_of_jobs_started_together_on_one_folder_one_holds_it(tmp_path, before):
    """Jobs starting at once on one folder (forked beside each other: rivals, none another's parent), empty or
    holding a dead job's lock: exactly one takes the lock, every other is refused naming it. A lock read while its
    writer was between creating and filling it was taken for a dead writer's garbage and taken over: two or more of
    four held it in up to a third of the tries, so the jobs meet on many folders. Two jobs taking over one dead
    job's lock at once both held it (one removed the lock the other had just written) about once in 40 rounds, until
    a take-over was claimed first (lock.py's _remove)."""
    ctx = multiprocessing.get_context("fork")
    jobs, rounds = 4, 40
    for attempt in range(rounds if before != "nothing" else 0):
        (tmp_path / str(attempt)).mkdir()
        _write_lock(tmp_path / str(attempt), host=HOST, pid=0)
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
        what = {pid: said[pid][attempt] for pid in said}
        assert all(w == "held" or w.startswith("CheckpointError: ") for w in what.values()), (attempt, what)
        holders = [pid for pid in said if said[pid][attempt] == "held"]
        assert len(holders) == 1, (attempt, what)
        assert json.loads((tmp_path / str(attempt) / LOCK).read_text())["pid"] == holders[0]
        refused = [w for pid, w in what.items() if pid != holders[0]]
        assert all(f"is in use by pid {holders[0]} on host {HOST}" in w for w in refused), (attempt, what)


def _as_rival(lock: CheckpointLock) -> CheckpointLock:
    """``lock`` as another live job of this host writes it: pid 1 (alive, and neither this process nor its parent)."""
    lock.me["pid"] = 1
    return lock


def test_a_rival_that_took_a_dead_lock_over_first_keeps_it(tmp_path, monkeypatch):
    """Two jobs judge one dead job's lock stale, and the rival takes it over between our judgement and our removal:
    ours must not remove the rival's new lock (then both held the folder: about 1 round in 40 of four forked jobs)
    but find it and be refused, naming the rival."""
    _write_lock(tmp_path, host=HOST, pid=0)
    rival, mine = _as_rival(CheckpointLock(tmp_path, "rival")), CheckpointLock(tmp_path, "mine")
    judge = CheckpointLock._stale

    def judge_then_rival(self, holder: dict) -> bool:
        verdict = judge(self, holder)
        if self is mine and holder.get("pid") == 0:
            assert rival.acquire() is not None  # the rival took the dead job's lock over
        return verdict

    monkeypatch.setattr(CheckpointLock, "_stale", judge_then_rival)
    with pytest.raises(CheckpointError, match=re.escape(f"in use by pid 1 on host {HOST} (run rival")):
        mine.acquire()
    assert json.loads((tmp_path / LOCK).read_text())["run"] == "rival" and not mine.held
    rival.release()


def test_a_job_removes_nothing_while_a_rival_takes_a_dead_lock_over(tmp_path):
    """A rival's take-over of a dead job's lock under way (its claim, fresh): the job waits instead of removing the
    lock, and once the rival holds the folder, is refused naming it; no claim is left behind."""
    dead = _write_lock(tmp_path, host=HOST, pid=0)
    rival = _as_rival(CheckpointLock(tmp_path, "rival"))
    claim, said = rival._claim(rival._snapshot()), []

    def mine() -> None:
        try:
            said.append(CheckpointLock(tmp_path, "mine").acquire() or "held")
        except CheckpointError as e:
            said.append(str(e))

    thread = threading.Thread(target=mine)
    thread.start()
    time.sleep(0.5)
    assert json.loads(dead.read_text())["pid"] == 0 and not said, "a lock under a rival's take-over was taken"
    record = tmp_path / "record"
    record.write_text(json.dumps(rival.me))
    os.replace(record, dead)  # the rival's lock in place of the dead job's (no moment without a lock)
    claim.unlink()
    thread.join(timeout=10)
    assert len(said) == 1 and f"in use by pid 1 on host {HOST} (run rival" in said[0], said
    assert not list(tmp_path.glob(f".{LOCK}-claim-*"))


def test_a_claim_left_by_a_taker_killed_mid_way_does_not_block_the_folder(tmp_path):
    """A job killed while taking a dead job's lock over leaves its claim: once the claim is older than a take-over
    can last (CLAIM_S), the next job takes the lock over, and leaves no claim of its own."""
    _write_lock(tmp_path, host=HOST, pid=0)
    killed = CheckpointLock(tmp_path, "killed")
    left = killed._claim(killed._snapshot())
    old = time.time() - CLAIM_S - 2
    os.utime(left, (old, old))
    lock = CheckpointLock(tmp_path, "new")
    assert f"taking over the lock of pid 0 on host {HOST}" in (lock.acquire() or "")
    assert json.loads((tmp_path / LOCK).read_text())["run"] == "new"
    assert list(tmp_path.glob(f".{LOCK}-claim-*")) == [left]
    lock.release()


def test_a_job_waits_out_a_fresh_claim_left_by_a_killed_taker(tmp_path, monkeypatch):
    """A taker killed a moment ago left a claim not yet CLAIM_S old: the job waits until it is (it cannot tell a
    killed taker from a slow one) and then takes the lock over, rather than giving up on a folder no job holds; it
    waits between looks (each writes a probe file to read the file system's clock), not in a busy loop."""
    _write_lock(tmp_path, host=HOST, pid=0)
    killed = CheckpointLock(tmp_path, "killed")
    left = killed._claim(killed._snapshot())
    young = time.time() - CLAIM_S + 1  # stale in a second
    os.utime(left, (young, young))
    looks, age = [], CheckpointLock._age
    monkeypatch.setattr(CheckpointLock, "_age", lambda self, path=None: looks.append(path) or age(self, path))
    lock = CheckpointLock(tmp_path, "new")
    assert f"taking over the lock of pid 0 on host {HOST}" in (lock.acquire() or "")
    assert 10 < looks.count(left) < 75, looks.count(left)  # a look per 20 ms of the second: <= 50 (busy: 120-700)
    lock.release()


def test_the_lock_file_is_readable_by_other_users(tmp_path):
    """Another user's job on a shared folder reads the lock, under the usual umask (022): one it cannot read names
    no holder and waits STALE_S (test_a_lock_another_user_cannot_read_is_judged_by_its_age)."""
    umask = os.umask(0)
    os.umask(umask)
    lock = CheckpointLock(tmp_path, "mine")
    lock.acquire()
    assert (tmp_path / LOCK).stat().st_mode & 0o777 == 0o644 & ~umask
    lock.release()


class _Ticks:
    """The holder's clock for its refresh loop: each wait() is one REFRESH_S gone by, after doing the next of
    ``events`` (what the file system did meanwhile); set() (release) or the last event ends the loop."""

    def __init__(self, *events):
        self.events = list(events)

    def wait(self, timeout: float) -> bool:
        if not self.events:
            return True
        self.events.pop(0)()
        return False

    def set(self) -> None:
        self.events = []


def test_the_holder_keeps_refreshing_after_its_lock_was_briefly_gone(tmp_path):
    """An NFS hiccup (the lock unreachable for one refresh) must not end the holder's refreshing: a thread that
    died on it left a live job's lock to go stale, and a job on another host took it over."""
    lock = CheckpointLock(tmp_path, "mine")
    lock.acquire()
    lock._released.set()  # the real thread ends; the loop below runs on _Ticks' clock, in this thread
    path, away, old = tmp_path / LOCK, tmp_path / "away", time.time() - 3 * STALE_S

    def back() -> None:
        away.rename(path)
        os.utime(path, (old, old))

    lock._released = _Ticks(lambda: path.rename(away), back, lambda: None)
    lock._refresh()
    assert path.stat().st_mtime > time.time() - STALE_S, "the holder stopped refreshing its lock"
    lock.release()


@pytest.mark.parametrize("pid", [0, -1])
def test_lock_of_a_pid_that_cannot_be_a_job_is_taken_over(tmp_path, capsys, pid):
    """A lock on this host naming pid 0 or below (no job's: os.kill would signal a group, or every process) is a
    dead one, taken over with a line, not refused forever."""
    _write_lock(tmp_path, host=HOST, pid=pid)
    lock = CheckpointLock(tmp_path, "new")
    assert f"taking over the lock of pid {pid} on host {HOST}" in (lock.acquire() or "")
    lock.release()


def test_lock_of_pid_1_is_a_live_job(tmp_path):
    """pid 1 is a job where the training runs as a container's first process: a second run started in that
    container is refused."""
    _write_lock(tmp_path, host=HOST, pid=1)
    with pytest.raises(CheckpointError, match=f"is in use by pid 1 on host {HOST}"):
        CheckpointLock(tmp_path, "new").acquire()


def test_refusing_a_live_job_leaves_it_running(tmp_path):
    """The second job asks whether the holder lives (signal 0): any other signal (1, SIGHUP) would end the very
    job it is refused by."""
    # SIGHUP's default action (ends it) even under nohup, which makes every child of the tests ignore it
    holder = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        _write_lock(tmp_path, host=HOST, pid=holder.pid)
        with pytest.raises(CheckpointError, match=f"is in use by pid {holder.pid} on host {HOST}"):
            CheckpointLock(tmp_path, "new").acquire()
        with pytest.raises(subprocess.TimeoutExpired):
            holder.wait(timeout=0.3)
    finally:
        holder.kill()
        holder.wait()


def _as_another_user(work):
    """What ``work()`` returns (or the exception it raises, as its type and words) in a forked job of another user:
    nobody, when the tests run as root."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def job() -> None:
        if os.getuid() == 0:
            os.setuid(65534)
        try:
            results.put(work())
        except Exception as e:  # reported to the test, which names it
            results.put(f"{type(e).__name__}: {e}")

    proc = ctx.Process(target=job)
    proc.start()
    try:
        return results.get(timeout=30)
    finally:
        proc.join()


def test_a_live_job_of_another_user_is_alive():
    """Another user's job on this host may not be signalled (EPERM): it is alive, and its lock is not stale."""
    judged = _as_another_user(
        lambda: CheckpointLock(Path("unused"), "new")._stale({"host": HOST, "pid": 1, "run": "old"})
    )
    assert judged is False, judged


@pytest.mark.skipif(os.getuid() != 0, reason="runs a job as another user (nobody), which needs root")
def test_a_lock_another_user_cannot_read_is_judged_by_its_age():
    """Another user's job under a private umask (077) writes a lock this job cannot read: it was taken for a dead
    writer's garbage and taken over at once, two jobs on one folder. Its holder is unknown, so it is judged as
    another host's: refused while refreshed, taken over once untouched for STALE_S."""
    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is root's alone (0700)
    try:
        for age, said in ((0, "is in use by an unreadable lock file (PermissionError"), (STALE_S + 5, "taking over")):
            folder = shared / str(age)
            folder.mkdir(parents=True)
            for d in (shared, folder):
                d.chmod(0o777)
            lock = _write_lock(folder)
            lock.chmod(0o600)
            old = time.time() - age
            os.utime(lock, (old, old))
            got = _as_another_user(lambda: CheckpointLock(folder, "nobody").acquire() or "held")
            assert said in got, (age, got)
            assert f"not refreshed for {age:.0f} s" in got or age == 0, got
    finally:
        shutil.rmtree(shared)


def _take_and_end(directory: Path) -> None:
    CheckpointLock(directory, "x").acquire()


def test_a_job_that_ends_without_releasing_its_lock_exits(tmp_path):
    """A job that fails after taking its lock, past any release(), still exits: the refresh thread is a daemon, not
    one the interpreter waits for (forever) at exit (a forked process waits for its threads as a script does). The
    next job takes over the dead one's lock."""
    job = multiprocessing.get_context("fork").Process(target=_take_and_end, args=(tmp_path,))
    job.start()
    job.join(timeout=10)
    try:
        assert job.exitcode == 0, "the job did not exit"
    finally:
        job.kill()
        job.join()
    lock = CheckpointLock(tmp_path, "new")
    assert "which is no longer running" in (lock.acquire() or "")
    lock.release()


def test_a_lock_that_vanishes_as_it_is_read_is_tried_again(tmp_path, monkeypatch):
    """A rival's lock gone between our try and our read (its job ended; another took it over), twice in a row: the
    job tries again and takes the folder, rather than failing with 'other jobs keep changing it'."""
    real_link, tries = os.link, []

    def link(src, dst, *args, **kwargs):
        tries.append(dst)
        if len(tries) <= 2:  # a rival's lock was there, and is gone when we read it
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    lock = CheckpointLock(tmp_path, "mine")
    assert lock.acquire() is None and len(tries) == 3
    assert json.loads((tmp_path / LOCK).read_text())["run"] == "mine"
    lock.release()


def test_a_lock_whose_age_cannot_be_read_counts_as_fresh(tmp_path):
    """Another host's lock whose age cannot be read on the file system's clock (here: the probe cannot be written)
    counts as fresh: refused, naming the file to delete, not taken over and not a traceback."""
    os.utime(_write_lock(tmp_path), (1, 1))  # untouched for decades
    (tmp_path / f".now-{os.getpid()}").mkdir()
    with pytest.raises(CheckpointError, match=f"delete {tmp_path / LOCK} if that job is gone"):
        CheckpointLock(tmp_path, "new").acquire()


@pytest.mark.parametrize("meanwhile", ["removed", "garbage", "another job's"])
def test_release_leaves_what_is_not_its_lock_and_never_fails(tmp_path, meanwhile):
    """The end of training (release) when the lock was removed by hand, overwritten with garbage or taken over by
    another job: no error at the end of a finished run, and another job's lock stays."""
    lock = CheckpointLock(tmp_path, "mine")
    lock.acquire()
    if meanwhile == "removed":
        (tmp_path / LOCK).unlink()
    elif meanwhile == "garbage":
        (tmp_path / LOCK).write_bytes(b"\x00{")
    else:
        _write_lock(tmp_path)
    lock.release()
    assert meanwhile == "removed" or (tmp_path / LOCK).exists()


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


def test_a_full_disk_is_named_as_such_when_taking_the_lock(tmp_path, tmpfs):
    """No inode left for the lock's record (the disk filled since the probe): the error is the disk's (ENOSPC, which
    the start-up line names with the free space), not the record file's absence as it is cleaned up."""
    disk = tmpfs(tmp_path / "disk", size="1m", nr_inodes=8)
    with pytest.raises(OSError) as full:
        for n in range(8):
            (disk / f"f{n}").write_text("")
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:
        CheckpointLock(disk, "mine").acquire()
    assert e.value.errno == errno.ENOSPC, e.value
    assert not (disk / LOCK).exists()


def _claim(out: Path, root: Path | None, *args: str) -> tuple[list[CheckpointLock], str | None]:
    """Rank 0's start-up claim of ``out`` (train.out_dir) and ``root`` (checkpoint.dir; None: nothing saved)."""
    cfg = load(["--train.out_dir", str(out), "--checkpoint.dir", str(root or ""), *args])
    return claim_run_directories(cfg, root, "tok1")


def _ours(directory: Path) -> bool:
    record = json.loads((directory / LOCK).read_text())
    return record["pid"] == os.getpid() and record["run"] == "tok1"


def test_both_directories_are_created_and_locked_and_released(tmp_path, capsys):
    """checkpoint.dir and train.out_dir are created with their missing parents and each holds this job's lock
    (two jobs on either would write one folder); release() removes both."""
    out, root = tmp_path / "a" / "b" / "out", tmp_path / "c" / "d" / "ckpt"
    out.mkdir(parents=True)
    _write_lock(out, host=HOST, pid=0)  # a dead job's: taken over with one line, the only one printed
    locks, error = _claim(out, root)
    assert error is None and _ours(out) and _ours(root)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("train.out_dir: taking over the lock of pid 0 on host"), said
    for lock in locks:
        lock.release()
    assert not (out / LOCK).exists() and not (root / LOCK).exists()


def test_without_a_checkpoint_dir_only_out_dir_is_locked_and_the_run_says_nothing_is_saved(tmp_path, capsys):
    """checkpoint.dir='' saves nothing: one line says so at start, and a 'latest' in out_dir (not a checkpoint
    directory then) is no concern of this run."""
    (tmp_path / "latest").mkdir()
    locks, error = _claim(tmp_path, None)
    assert error is None and [lock.path for lock in locks] == [tmp_path / LOCK]
    assert "checkpoint.dir is empty: no checkpoint will be saved" in capsys.readouterr().out
    locks[0].release()


def test_a_directory_that_cannot_be_claimed_is_one_line_and_no_lock_is_kept(tmp_path):
    """checkpoint.dir under a file (cannot be created), its LOCK a directory (cannot be replaced), or a file the run
    writes that is a directory: one line naming the setting and the path, and train.out_dir's lock, already
    taken, is released (a job that never ran must not lock out the next)."""
    (tmp_path / "file").write_text("x")
    cases = {
        tmp_path / "file" / "ckpt": "checkpoint.dir '{root}' cannot be written: cannot write ",
        tmp_path / "lockdir": "checkpoint.dir: cannot write '{root}/LOCK': ",
        tmp_path / "latestdir": "checkpoint.dir: '{root}/latest' is not a file, and the run writes it; move it away",
    }
    (tmp_path / "lockdir" / LOCK).mkdir(parents=True)
    (tmp_path / "latestdir" / "latest").mkdir(parents=True)
    for root, says in cases.items():
        locks, error = _claim(tmp_path / "out", root)
        assert locks == [] and error is not None and error.startswith(says.format(root=root)), (root, error)
        assert "\n" not in error and not (tmp_path / "out" / LOCK).exists(), error


def test_a_disk_error_while_taking_a_lock_names_that_lock(tmp_path, monkeypatch):
    """The disk failing (EIO, a full disk) between the probe and the lock: one line naming the setting and the
    lock it could not write (and the free space of that disk), not train.out_dir's taken before it."""
    real_link, root = os.link, tmp_path / "ckpt"

    def link(src, dst, *args, **kwargs):
        if Path(dst).parent == root:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    locks, error = _claim(tmp_path / "out", root)
    assert locks == [] and not (tmp_path / "out" / LOCK).exists()
    assert error is not None and error.startswith(f"checkpoint.dir: cannot write '{root / LOCK}': Input/output error")


def test_a_metrics_file_that_cannot_be_appended_to_is_one_line(tmp_path):
    """metrics.jsonl that the run cannot append to (here a file no one may write, root included): one line at
    start, not an error after the first step."""
    (tmp_path / "metrics.jsonl").symlink_to("/proc/version")
    locks, error = _claim(tmp_path, None)
    assert locks == [] and error is not None, error
    assert error.startswith(f"train.out_dir: cannot write '{tmp_path / 'metrics.jsonl'}': "), error
    assert error.endswith("; make it writable or move it away"), error


def test_files_the_run_writes_must_not_be_directories(tmp_path):
    """metrics.jsonl in train.out_dir and latest in checkpoint.dir (also when checkpoint.dir is out_dir) are
    checked; a checkpoint.dir apart from out_dir may hold a folder named metrics.jsonl, and out_dir one named
    latest."""
    (tmp_path / "out" / "metrics.jsonl").mkdir(parents=True)
    locks, error = _claim(tmp_path / "out", tmp_path / "ckpt")
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert error == f"train.out_dir: '{metrics}' is not a file, and the run writes it; move it away", error
    for name, out, root in [("latest", tmp_path / "o1", tmp_path / "o1"), ("metrics.jsonl", tmp_path / "o2", None)]:
        (out / name).mkdir(parents=True, exist_ok=True)
        assert _claim(out, root)[1] is not None, name
    (tmp_path / "c3" / "metrics.jsonl").mkdir(parents=True)
    (tmp_path / "o3" / "latest").mkdir(parents=True)
    locks, error = _claim(tmp_path / "o3", tmp_path / "c3")
    assert error is None, error
    for lock in locks:
        lock.release()


def test_tensorboard_directory_that_is_a_file_is_checked_only_with_tensorboard(tmp_path):
    (tmp_path / "tensorboard").write_text("x")
    locks, error = _claim(tmp_path, None)
    assert error is None
    locks[0].release()
    assert _claim(tmp_path, None, "--log.tensorboard", "true")[1] == (
        f"log.tensorboard's directory '{tmp_path / 'tensorboard'}' is not a directory; "
        "move it away, or set log.tensorboard=false"
    )


def test_a_step_folder_or_a_folder_inside_one_is_refused_naming_which(tmp_path):
    """A checkpoint step folder as checkpoint.dir (issue 42 item 11): the line says whether the directory is the
    step or lies inside it; the checkpoint directory itself is fine."""
    (tmp_path / "step_000001" / "sub").mkdir(parents=True)
    (tmp_path / "latest").write_text("step_000001\n")
    refuse_a_step(tmp_path, "checkpoint.dir")
    with pytest.raises(CheckpointError, match=f"'{tmp_path / 'step_000001'}' is a checkpoint step of {tmp_path} "):
        refuse_a_step(tmp_path / "step_000001", "checkpoint.dir")
    step = tmp_path / "step_000001"
    with pytest.raises(CheckpointError, match=f"lies inside {step}, which is a checkpoint step of {tmp_path} "):
        refuse_a_step(step / "sub", "checkpoint.dir")
