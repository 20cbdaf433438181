"""Start-up checks of ``checkpoint.dir`` and ``train.out_dir``: each can be created and written, and no other live
job uses it (two runs on one out_dir would interleave their metrics.jsonl records).

Run by rank 0 before the first step, so a read-only mount, a full disk or a path that is a file fails in seconds
with one line (naming the free space, engine/storage.py) instead of losing the training done before the first
save. The probe does what the run will do there: create a directory (a checkpoint's staging directory) and write,
fsync and delete a file inside it; the files the run appends to or replaces (metrics.jsonl and its siblings,
``latest``) must not be directories, and neither may be a checkpoint's step folder or lie inside one (pruning
deletes it whole: ``refuse_a_step``). The lock is ``<dir>/LOCK``, holding JSON
``{"host", "pid", "started", "run", "elastic"}``: written whole to a file of the job's own and hard-linked as LOCK
(the link fails if a lock exists), so a rival never reads a lock half-written (``O_EXCL`` where the file system has
no hard links). A second job finds it and is refused, naming the holder.
A lock left by a dead process on this host (a crash, ``kill -9``, a torchrun restart: new worker pids) is taken over
with a message (one that is not JSON, written by a writer killed mid-write, too; one this job may not read, another
user's, is judged by its age as another host's). A process on another host cannot be asked, so the holder refreshes its
lock (the file's mtime, every ``REFRESH_S``) from a daemon thread: a lock from another host not refreshed for
``STALE_S`` (the holder died, froze or lost the file system; a requeued job's rank 0 landed elsewhere) is taken over
with one line, a fresher one is refused. Ages are read on the file system's clock (a file written now beside it), so
hosts whose clocks disagree still agree on them. Jobs judging one stale lock at once take it over one at a time: a
take-over first creates a claim named by the stale record (``_remove``), so the next finds the new holder's lock.
A lock of an earlier restart round of this same torchrun job (``elastic``: its --rdzv-id and restart count; README
"Elastic restart") is taken over at once, on any host: torchrun ends every worker of a round before the next starts.
A lock held by this process or by the process that forked it (tests/dist.py ranks after an in-process run) is
this job's own. Because only the lock holder saves, the clean-up of ``step_*.tmp-*`` directories never meets
another live job's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.publish import enclosing_step
from engine.storage import describe

LOCK = "LOCK"
METRICS = ("metrics.jsonl", "metrics.rolled_back.jsonl", "metrics.jsonl.tmp")  # engine/metrics/logger.py
REFRESH_S = 10.0  # the holder touches its lock this often
STALE_S = 60.0  # a lock from another host untouched this long is a dead job's (6 missed refreshes)
CLAIM_S = 5.0  # a take-over claim this old is a taker's killed mid-way (a take-over lasts milliseconds)
CLAIM_LEVELS = 4  # claims on one stale record, each taken only when those before it are a killed taker's
ACQUIRE_S = 3 * CLAIM_S  # waiting on rivals' take-overs longer than this: "other jobs keep changing it"
NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP)  # link(2)'s answers where the file system has none


CHECKPOINT_HINT = "give a writable directory to save checkpoints in, or checkpoint.dir='' to save nothing"


def probe_writable(root: Path, token: str, setting: str = "checkpoint.dir", hint: str = CHECKPOINT_HINT) -> None:
    """Create ``root`` (and parents), a probe directory in it and a file in that (written, fsynced, deleted):
    what a checkpoint's staging directory and its shards need; CheckpointError naming ``setting`` (the config key
    that chose root) and ``hint`` (what to do) if not."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{setting} '{root}' is not a directory; {hint}")
    probe = root / f".probe-{token}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.mkdir()
        with open(probe / "probe", "w") as f:
            f.write("probe\n")
            f.flush()
            os.fsync(f.fileno())
        (probe / "probe").unlink()
        probe.rmdir()
    except OSError as e:
        raise CheckpointError(f"{setting} '{root}' cannot be written: {describe(root, e)}; {hint}") from None


def probe_files(root: Path, names: tuple[str, ...], setting: str) -> None:
    """The files the run appends to or replaces in ``root`` must be files if they exist (one that is a
    directory failed after the first step, IsADirectoryError), and those it appends to (METRICS) open for appending
    (nothing is changed). ``latest`` is replaced by a rename (publish.py), so its own permissions do not matter:
    an unreadable one is skipped by ``resume: auto`` (choose.py) and replaced at the next save."""
    for name in names:
        path = root / name
        if path.exists() and not path.is_file():
            raise CheckpointError(f"{setting}: '{path}' is not a file, and the run writes it; move it away")
        try:
            if path.exists() and name in METRICS:
                open(path, "ab").close()
        except OSError as e:
            raise CheckpointError(f"{setting}: {describe(path, e)}; make it writable or move it away") from None


def _write_new(path: Path, text: str, flag: int) -> None:
    """Create ``path`` (``flag``: O_EXCL fails if it exists, O_TRUNC empties it) readable by other users' jobs, and
    write ``text`` to the disk."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | flag, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _elastic_round() -> list | None:
    """[torchrun's --rdzv-id, its restart round] (None outside torchrun or with the default id "none", which
    unrelated jobs share)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return None if run_id in ("", "none") else [run_id, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)]


def _describe(holder: dict) -> str:
    if holder.get("unreadable"):
        why = holder.get("why", "its writer was probably killed mid-write")
        return f"an unreadable lock file ({holder['unreadable']}; {why})"
    started = holder.get("started")
    since = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, (int, float)) and started > 0
        else "an unknown time"
    )
    return f"pid {holder.get('pid')} on host {holder.get('host')} (run {holder.get('run')}, since {since})"


class CheckpointLock:
    """rank 0's exclusive claim on a directory (``setting`` names its config key in messages); ``release()`` at
    the end of training."""

    def __init__(self, root: Path, run: str, setting: str = "checkpoint.dir"):
        self.path, self.setting = root / LOCK, setting
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "run": run,
            "elastic": _elastic_round(),
        }
        self.held = False
        self._released = threading.Event()

    def acquire(self) -> str | None:
        """Take the lock; returns a message when a stale lock was taken over. CheckpointError if held."""
        message, deadline = None, time.monotonic() + ACQUIRE_S
        while time.monotonic() < deadline:  # a racing job may create or remove the lock between our attempts
            if self._create():
                self.held = True
                threading.Thread(target=self._refresh, name="engine-lock", daemon=True).start()
                return message
            seen = self._snapshot()
            if seen is None:
                continue
            holder = self._holder(seen)
            if not self._stale(holder):
                raise CheckpointError(
                    f"{self.setting} '{self.path.parent}' is in use by {_describe(holder)}; use another "
                    f"{self.setting}, or delete {self.path} if that job is gone"
                )
            if not self._ours(holder):
                message = f"{self.setting}: taking over {self._taken_over(holder)}"
            if not self._remove(seen):
                time.sleep(0.02)  # a rival is taking it over: its lock (or none) is read next
        raise CheckpointError(f"could not take the lock {self.path} (other jobs keep changing it)")

    def _create(self) -> bool:
        """Write this job's record whole to a file of its own and link it as the lock; False if a lock exists. Jobs
        starting together on one folder each took the others' lock, still empty, for the garbage of a writer killed
        mid-write and took it over: four forked at once, two or more held it in a third of the tries (issue 45)."""
        record = json.dumps(self.me) + "\n"
        mine = self.path.with_name(f".{LOCK}-{self.me['pid']}-{self.me['run']}")
        try:
            _write_new(mine, record, os.O_TRUNC)
            os.link(mine, self.path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in NO_HARD_LINKS:
                raise
            try:
                _write_new(self.path, record, os.O_EXCL)
            except FileExistsError:
                return False
        finally:
            mine.unlink(missing_ok=True)
        return True

    def _snapshot(self) -> tuple | None:
        """The lock as read now: its identity (device, inode, mtime) and bytes (an error's name if unreadable);
        None if there is none."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        try:
            data: bytes | str = self.path.read_bytes()
        except FileNotFoundError:  # removed between the two
            return None
        except OSError as e:
            data = type(e).__name__
        return st.st_dev, st.st_ino, st.st_mtime_ns, data

    def _holder(self, seen: tuple) -> dict:
        """The holder's record; a record that is not JSON (a writer killed mid-write) counts as a dead one here. A
        file this job may not read (another user's job under a private umask) may be a live job's: its holder is
        unknown, judged by the lock's age as another host's (it was taken for a dead writer's garbage and taken
        over at once, issue 45)."""
        data = seen[-1]
        if data == PermissionError.__name__:
            return {
                "host": None,
                "unreadable": data,
                "why": f"this job cannot read it; judged by its age, {STALE_S:.0f} s",
            }
        if isinstance(data, str):  # another error (LOCK a directory): taken over, which names the error
            return {"host": self.me["host"], "unreadable": data}
        try:
            holder = json.loads(data)
        except ValueError as e:  # not JSON, or not UTF-8
            return {"host": self.me["host"], "unreadable": type(e).__name__}
        return holder if isinstance(holder, dict) else {"host": self.me["host"], "unreadable": "not a JSON object"}

    def _remove(self, seen: tuple) -> bool:
        """Remove the stale lock ``seen`` unless another job is taking it over; False then. Two jobs that judged one
        dead job's lock stale both removed it, the second removing the first's new lock: both held it (about 1
        round in 40 with four jobs, issue 45). Each take-over first creates a claim named by the stale record
        (O_EXCL: one job gets it) and removes the lock only if it is still that very record (same inode, mtime and
        bytes): the next job's claim, once the first is done, finds another record and removes nothing."""
        claim = self._claim(seen)
        if claim is None:
            return False
        try:
            if self._snapshot() == seen:
                self.path.unlink(missing_ok=True)
        finally:
            claim.unlink(missing_ok=True)
        return True  # the lock is read again at once: this job's to create, or a rival's record

    def _claim(self, seen: tuple) -> Path | None:
        """This job's claim on taking over the record ``seen``, or None while another job's is live. A claim is never
        removed by a rival (two removing one would both take it): a claim older than CLAIM_S (its taker was killed
        mid-way) passes the turn to the next level's."""
        name = hashlib.sha256(repr(seen).encode()).hexdigest()[:16]
        for level in range(CLAIM_LEVELS):
            claim = self.path.with_name(f".{LOCK}-claim-{name}-{level}")
            try:
                _write_new(claim, json.dumps(self.me) + "\n", os.O_EXCL)
                return claim
            except FileExistsError:
                if self._age(claim) <= CLAIM_S:
                    return None
        return None

    def _ours(self, holder: dict) -> bool:
        """This very process (a second Trainer in one process) or the one that forked it (tests/dist.py ranks
        after an in-process run in the parent): the same job, not a rival."""
        return holder.get("host") == self.me["host"] and holder.get("pid") in (self.me["pid"], os.getppid())

    def _taken_over(self, holder: dict) -> str:
        """What a stale lock (``_stale``) was, for the take-over line."""
        if "unreadable" in holder and holder.get("host") == self.me["host"]:
            return _describe(holder)
        if self._earlier_round(holder):
            return f"the lock of {_describe(holder)}, from restart round {holder['elastic'][1]} of this torchrun job"
        if holder.get("host") == self.me["host"]:
            return f"the lock of {_describe(holder)}, which is no longer running"
        what = _describe(holder) if "unreadable" in holder else f"the lock of {_describe(holder)}"
        return f"{what}, not refreshed for {self._age():.0f} s (> {STALE_S:.0f} s)"

    def _age(self, path: Path | None = None) -> float:
        """Seconds since ``path`` (the lock) was last written or refreshed, on the file system's clock."""
        probe = self.path.with_name(f".now-{self.me['pid']}")
        try:
            probe.write_text("")
            now = probe.stat().st_mtime
            probe.unlink()
            return now - (path or self.path).stat().st_mtime
        except OSError:
            return 0.0  # cannot tell: count it as fresh (refused, naming the file to delete)

    def _refresh(self) -> None:
        while not self._released.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:  # gone or unreachable for now: the next refresh tries again
                pass

    def _earlier_round(self, holder: dict) -> bool:
        mine, theirs = self.me["elastic"], holder.get("elastic")
        return (
            bool(mine)
            and isinstance(theirs, list)
            and len(theirs) == 2
            and theirs[0] == mine[0]
            and isinstance(theirs[1], int)
            and theirs[1] < mine[1]
        )

    def _stale(self, holder: dict) -> bool:
        """Ours, or dead on this host (a crash, kill -9, a torchrun restart), or from an earlier round of this
        torchrun job on any host (an elastic restart after the lock holder's host left), or from another host and
        not refreshed for STALE_S."""
        if self._earlier_round(holder):
            return True
        if holder.get("host") != self.me["host"]:
            return self._age() > STALE_S
        pid = holder.get("pid")
        return not isinstance(pid, int) or pid <= 0 or self._ours(holder) or not _alive(pid)

    def release(self) -> None:
        if self.held:
            self.held = False
            self._released.set()
            try:
                if json.loads(self.path.read_text()).get("run") == self.me["run"]:
                    self.path.unlink()
            except (OSError, ValueError):
                pass


def claim_run_directories(cfg, root: Path | None, token: str) -> tuple[list[CheckpointLock], str | None]:
    """Rank 0, before the first step: train.out_dir (and its tensorboard/ under log.tensorboard) and checkpoint.dir
    (``root``, None when no checkpoint is saved) are writable directories and this job's alone; returns the locks
    taken and an error message (every rank raises it; no lock is then kept) or None. checkpoint.dir may be out_dir
    itself (one lock) or inside it (two)."""
    out = Path(cfg.train.out_dir)
    claims = [(out, "train.out_dir", "give a writable directory for the run's metrics")]
    if root is not None and root.resolve() != out.resolve():
        claims.append((root, "checkpoint.dir", CHECKPOINT_HINT))
    locks: list[CheckpointLock] = []
    try:
        for directory, setting, hint in claims:
            refuse_a_step(directory, setting)
            probe_writable(directory, token, setting, hint)
            ckpt = root is not None and directory.resolve() == root.resolve()
            probe_files(directory, (METRICS if directory == out else ()) + (("latest",) if ckpt else ()), setting)
            locks.append(CheckpointLock(directory, token, setting))
            try:
                message = locks[-1].acquire()
            except OSError as e:  # the disk filled (or turned read-only) since the probe
                raise CheckpointError(f"{setting}: {describe(locks[-1].path, e)}; {hint}") from None
            if message:
                print(message, flush=True)
        if cfg.log.tensorboard:  # SummaryWriter would raise FileExistsError from deep inside
            probe_writable(
                out / "tensorboard", token, "log.tensorboard's directory", "move it away, or set log.tensorboard=false"
            )
    except CheckpointError as e:
        for lock in locks:
            lock.release()
        return [], str(e)
    if root is None:
        print(
            "checkpoint.dir is empty: no checkpoint will be saved, not even on SIGTERM (set "
            "--checkpoint.dir DIR to keep the weights)",
            flush=True,
        )
    return locks, None


def refuse_a_step(directory: Path, setting: str) -> None:
    """CheckpointError when ``directory`` is a checkpoint's step folder or lies inside one: a run saving there
    restarted at step 1 and wrote its steps inside the step, which the next pruning deletes with them."""
    step = enclosing_step(directory.resolve())
    if step is None:
        return
    where = "is" if step == directory.resolve() else f"lies inside {step}, which is"
    raise CheckpointError(
        f"{setting} '{directory}' {where} a checkpoint step of {step.parent} (pruning deletes it whole, and what "
        f"is inside); give a directory outside it (checkpoint.dir={step.parent} continues that run, "
        f"checkpoint.resume={step} starts from that step)"
    )
