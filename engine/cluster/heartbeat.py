"""Heartbeat and watchdog: a rank whose peer has gone silent ends itself within ``parallel.heartbeat_timeout_s``,
naming the peer, whatever the main thread is blocked in (a collective, a pipeline recv, a checkpoint write).

A collective's own timeout (``parallel.timeout_s``) must stay long enough for the biggest all-gather or the
slowest checkpoint barrier, so it cannot also be what notices a frozen host (SIGSTOP, a hung driver) or a
partition: that costs the whole ``timeout_s``, then a traceback from every rank. Here a daemon thread per rank
talks to the job's c10d store (MASTER_ADDR:MASTER_PORT, its own client connection) every ``timeout / BEATS``
seconds: it sets its own counter ``hb/<rank>`` (with the current step), and a third thread blocks on the key
``ended`` on a connection of its own, which the verdict sets.

Who reads whose counter (issue 43: every rank reading every rank's was 2N^2 key look-ups a round, 84 s of the
store's one thread per 3 s round at 4,096 ranks, and ~3N requests per rank at start-up). The ranks are cut into
slices of a host's ranks (``LOCAL_WORLD_SIZE``, the deepspeed launcher's ``LOCAL_SIZE``: both launchers number
ranks host by host; 8 where neither is set); the first rank of each slice is its watcher and reads the *next*
slice's counters in one ``multi_get`` (slice 0 is read by the last slice's watcher), so every rank is read by
exactly one watcher in another slice (on another host where slices are hosts) and every watcher is itself
watched. Per beat a rank sets its counter (a request with no reply), a watcher reads O(slice) keys in one more,
and the others read ``verdict`` every ``POLL``-th beat (a store that stops answering is seen by every rank for
itself, and a verdict the listener missed still arrives): the store does O(N) work a round, O(1) per rank, at any
N, plus one held wait per rank for the whole job (``launch/bench/scale_store.py`` measures it;
tests/cluster/test_scale.py counts it at 1,024 simulated ranks).
This is how the peers at scale do it: TorchFT's lighthouse takes one heartbeat per replica group from that group's
manager, never one per rank per rank, and NVRx's per-node rank monitors take each rank's heartbeat on its own node
and only report a failure; here the store is the only server every host can reach, so the per-host watcher reads
its slice there. A watcher whose counter of a peer has not moved for ``timeout`` seconds of *its* clock (no
clock is compared across hosts) posts one line to ``verdict`` (compare-set, so every rank reports the same line)
and copies it to ``ended``, which wakes every rank's listener at once (so a frozen host is named to every rank between
``timeout - 1 beat`` and ``timeout + 2 beats`` after it froze, as when every rank read every counter); each rank
prints it once per host (engine/cluster/report.py) and leaves with ``os._exit`` (a thread cannot unblock a
collective; the checkpoint on disk stays the last committed one). A store that stops answering for ``timeout``
seconds is reported as such, naming the host that serves it, and ends the rank too: every rank has a request
answered every POLL beats at least, and a second thread that never calls the store sees it when a store call hangs
(a frozen or cut store host never answers, and the client's timeout does not bound waiting for a reply). A rank
that finishes writes ``done`` and is never called silent; one that fails on its own writes ``failed`` and is named
at once.

After a rank's main thread saw a collective fail (``explain``: a killed peer closes its sockets, gloo fails within
seconds), it posts ``alarm``: every watcher then needs only ``ALARM_BEATS`` beats of silence to name a peer dead, and
every alarmed rank beats ``FAST`` times as often, so a dead peer is named in seconds, in one line.

Ending (``_finish``): a rank that ends on a verdict waits (bounded) until every rank the verdict left alive has read
it, so the host serving the store never takes the store away before a healthy host learnt the culprit
(engine/cluster/verdict.py); a rank that lost the store prints the same line on every host. Under torchrun it
then starts engine/cluster/agentwatch.py, which ends its agent if that agent is blocked on a frozen store and
would otherwise outlive its workers for as long as the freeze lasts.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta

from engine.cluster import agentwatch
from engine.cluster.report import report_once
from engine.cluster.verdict import LIVE_KEY, acknowledge, store_host
from engine.errors import ConfigError

BEATS = 10  # beats per timeout: a silent peer is seen between timeout and timeout + timeout / BEATS
ALARM_BEATS = 3  # after a failed collective: beats of silence that name a peer dead
FAST = 3  # after a failed collective: beats per interval, so the verdict comes through within a third of one
SLICE = 8  # ranks a watcher reads where LOCAL_WORLD_SIZE is unset
POLL = 3  # a rank that watches nothing reads ``verdict`` every POLL-th beat (the listener hears it at once)
LISTEN_S = 86400.0  # a listener's wait is renewed this often (each expiry logs two lines of torch's)
MAX_SLICE = 64  # a larger LOCAL_WORLD_SIZE is cut into slices of SLICE: a watcher's read stays O(1)
EXIT_CODE = 1
PREFIX = "engine-heartbeat"


def store_address() -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of the job's store, as the launcher set them (127.0.0.1:29500 where unset);
    ConfigError naming a port that is not a TCP port number (MASTER_PORT=abc was a ValueError traceback)."""
    raw = os.environ.get("MASTER_PORT", "29500")
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={raw!r} is not a TCP port; give a number in 1-65535")
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), port


def host_name() -> str:
    """This host as a person would call it: the host name and the address that routes to the store (network
    namespaces share one host name, so the address tells them apart)."""
    name, master = socket.gethostname(), os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # UDP: picks the route, sends nothing
            address = s.getsockname()[0]
    except OSError:
        return name
    return f"{name} ({address})"


def launch_round() -> str:
    """This launch round's key in the job's store. Workers that share the torchrun agent's store (kept from round
    to round) key on the agent's restart count, as torch does (``/worker/attempt_N``). With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every round has a fresh store (rank 0's worker serves it, at a port its agent
    picks for the round) and needs no key: there the count would split a round, since it is each agent's own (the
    failures it restarted, not the hosts that joined or left): after a membership change the agents' counts differ,
    and workers keying on them never saw each other."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "0"


def namespace() -> str:
    """Keys of this launch round: a torchrun restart may share the agent's store with the dead round."""
    return f"{PREFIX}/{launch_round()}/"


def connect(timeout_s: float):
    """A client of the job's store with its own connection (the process group's is not shared with a thread)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        *store_address(),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(namespace(), store)


def slice_size(world: int, local: int | None = None) -> int:
    """Ranks per slice: a host's (``local``, else LOCAL_WORLD_SIZE from torchrun or LOCAL_SIZE from the deepspeed
    launcher) when it is 1 to MAX_SLICE, SLICE otherwise; at most half the world, so that there are two slices and
    a watcher is read by another slice's."""
    if local is None:
        value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE", "")
        local = int(value) if value.isdigit() else 0
    size = local if 0 < local <= MAX_SLICE else SLICE
    return max(1, min(size, -(-world // 2)))


def watched(rank: int, world: int, size: int) -> list[int]:
    """The ranks whose counters ``rank`` reads each beat: the next slice's if it is the first of its own slice (a
    watcher), none otherwise. Slice s is read by slice s - 1's first rank, slice 0 by the last slice's."""
    if rank % size or world < 2:
        return []
    nxt = (rank // size + 1) % -(-world // size)
    return list(range(nxt * size, min(world, (nxt + 1) * size)))


def describe_ranks(ranks: list[int], hosts: dict[int, str]) -> str:
    """'rank 3 on host b (10.0.0.2)', 'ranks 2, 3 on host b (...)' grouped per host."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(hosts.get(r, "an unknown host"), []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on host {h}" for h, rs in by_host.items()]
    return "; ".join(parts)


class Heartbeat:
    """One rank's beat and watchdog thread. ``step`` is read from ``step_of()`` (the trainer's step) at each beat."""

    def __init__(
        self,
        rank: int,
        world: int,
        timeout_s: float,
        step_of=lambda: 0,
        exit_fn=os._exit,
        local: int | None = None,
        startup_s: float = 0.0,
    ):
        self.rank, self.world, self.timeout = rank, world, timeout_s
        self.startup_s = startup_s  # the silence allowed at step 0 (start-up): _limit
        self.watched = watched(rank, world, slice_size(world, local))  # ``local``: ranks per host, if not the env's
        self._keys = [f"hb/{r}" for r in self.watched] + ["verdict", "alarm"]
        self._present = not self.watched  # every watched counter exists (checked until it does, then never again)
        self._last: dict[int, str] = {}
        self._seen: dict[int, float] = {}
        self._beats, self._started, self._posted = 0, 0.0, False
        self._alarmed = False  # a rank's collective failed somewhere: the store's ``alarm``
        self.interval = max(0.2, timeout_s / BEATS)
        # a store operation waits this long at most: a frozen store is named within timeout + op_timeout + interval
        self.op_timeout = max(self.interval, timeout_s / 3)
        self.step_of, self.exit_fn = step_of, exit_fn
        self.hosts: dict[int, str] = {}
        self._hosts_loaded = False
        self.verdict: str | None = None  # the line this rank ended with
        self.alarm = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-heartbeat", daemon=True)
        # A store call never returns while the store's host is frozen or cut off (the client's timeout bounds
        # waiting for a key, not for the server's reply): a second thread, which never calls the store, watches
        # the first one's last answered beat.
        self._guard_thread = threading.Thread(target=self._guard, name="engine-heartbeat-guard", daemon=True)
        self._listener = threading.Thread(target=self._listen, name="engine-heartbeat-listener", daemon=True)
        self._store_ok = time.monotonic()
        self._ending = threading.Lock()
        self._store_lost = False  # the line is the store's: no store to acknowledge the verdict through
        self.store_addr = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}"

    def start(self) -> "Heartbeat":
        self._thread.start()
        self._guard_thread.start()
        self._listener.start()
        return self

    def stop(self, state: str = "done") -> None:
        """This rank leaves: ``done`` (peers never call it silent) or ``failed`` (its own error, printed by itself:
        peers name it at once instead of reporting their broken collectives); and stops watching."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)

        def tell() -> None:
            try:
                connect(self.op_timeout).set(f"hb/{self.rank}", state)
            except Exception:  # noqa: BLE001  the store may already be gone with the job; nothing to tell then
                pass

        teller = threading.Thread(target=tell, daemon=True)  # a frozen store would hold a store call forever
        teller.start()
        teller.join(timeout=self.op_timeout)

    def explain(self, wait_s: float | None = None) -> None:
        """The main thread's collective failed: shorten the silence that names a peer and give the watchdog time to
        post its verdict (it ends the process). Returns when no peer turned out silent: the error is this rank's."""
        self.alarm.set()
        deadline = time.monotonic() + (wait_s if wait_s is not None else (ALARM_BEATS + 3) * self.interval)
        while not self._stop.is_set() and (time.monotonic() < deadline or self.verdict is not None):
            time.sleep(0.05)  # a verdict being finished (acknowledged: _finish) ends this process

    # ---- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        store, wait = None, 0.0
        while not self._stop.wait(wait):
            wait, now = self._period(), time.monotonic()
            try:
                if store is None:
                    store = connect(self.op_timeout)
                    self.enter(store)
                values, answered = self.exchange(store)
                self._store_ok = now if answered else self._store_ok
            except Exception:  # noqa: BLE001  unreachable, reset, timed out: the same to us
                # The same client tries again next beat: a new one per beat would dump a C++ stack trace per beat
                # into the log while the store is away, and one that never connected tries to connect again.
                now = time.monotonic()
                if now - self._store_ok > self._store_limit():
                    self._end(self._store_line())
                continue
            self.judge(store, values, now)

    def enter(self, store) -> None:
        """Once, on a new connection: this rank's host name and counter (a watcher's first read finds every counter
        of a slice that has started); a watcher makes sure ``verdict`` and ``alarm`` exist (its multi_get would
        wait for an absent key)."""
        store.multi_set([f"host/{self.rank}", f"hb/{self.rank}"], [host_name(), "0 0"])
        if self.watched:
            store.compare_set("verdict", "", "")
            store.compare_set("alarm", "", "")

    def exchange(self, store) -> tuple[list[str | None], bool]:
        """One beat's store traffic: this rank's counter (a set: no reply), then one read: a watcher's
        ``multi_get`` of its slice's counters, ``verdict`` and ``alarm``; anyone else's ``verdict`` alone
        (compare-set with "" for "": one round trip, where get is two), every POLL-th beat. ([counters...,
        verdict, alarm], whether the store answered); the counters are None until all of them exist (start-up: a
        rank that never beats is silent from the start)."""
        if self.alarm.is_set() and not self._posted:
            store.set("alarm", str(self.rank))
            self._posted = True
        self._beats += 1
        store.set(f"hb/{self.rank}", f"{self._beats} {self.step_of()}")
        if not self._present:
            self._present = store.check(self._keys[:-2])
        if not self._present:
            return [None] * len(self.watched) + [store.compare_set("verdict", "", "").decode(), ""], True
        if not self.watched:  # every POLL-th beat: an answer that shows the store alive, and the line if the
            poll = self._beats % POLL == 1 or self.alarm.is_set()  # listener missed it
            return [store.compare_set("verdict", "", "").decode() if poll else "", ""], poll
        return [v.decode() for v in store.multi_get(self._keys)], True

    def judge(self, store, values: list[str | None], now: float) -> None:
        """What the beat read means: a verdict to end with, an alarm to heed, a watched peer failed or silent."""
        if values[-2]:
            self._end(self._announce(store, values[-2]))
            return
        self._alarmed = self._alarmed or bool(values[-1])
        if not self._hosts_loaded:
            self._load_hosts(store)
        self._started = self._started or now
        for r, v in zip(self.watched, values):
            if v is not None and v != self._last.get(r):
                self._last[r], self._seen[r] = v, now
        seen = {r: self._seen.get(r, self._started) for r in self.watched}
        failed = [r for r in self.watched if self._last.get(r) == "failed"]
        silent = failed or [r for r in self.watched if self._last.get(r) != "done" and now - seen[r] > self._limit()]
        if silent and not self._present:  # some counter never appeared: the absent ones are silent (none: all
            silent = self._absent(store)  # appeared just now)
        if silent:
            line = self._verdict(store, silent, bool(failed), now - min(seen[r] for r in silent))
            self._end(self._announce(store, line))

    @staticmethod
    def _announce(store, line: str) -> str:
        """Wake every rank's listener with the verdict (a set, no reply; again by whoever reads it: the one who
        posted it may have died in between)."""
        try:
            store.set("ended", line)
        except Exception:  # noqa: BLE001  the others read ``verdict`` within POLL beats
            pass
        return line

    def _listen(self) -> None:
        """Blocks on ``ended`` on a connection of its own (a blocked wait holds its client): a verdict reaches this
        rank as soon as it is posted, for two requests a job. The store going away ends it: the beat thread and
        the guard name that."""
        try:
            store = connect(self.op_timeout)
            while not store.check(["ended"]):
                try:
                    store.wait(["ended"], timedelta(seconds=LISTEN_S))
                except Exception:  # noqa: BLE001  expired, or the store is gone: the check tells
                    time.sleep(self.interval)
            line = store.get("ended").decode()
        except Exception:  # noqa: BLE001
            return
        self._end(line)

    def _absent(self, store) -> list[int]:
        """The watched ranks that never beat (one check each, once: at a start-up verdict only)."""
        try:
            return [r for r in self.watched if not store.check([f"hb/{r}"])]
        except Exception:  # noqa: BLE001
            return []

    def _guard(self) -> None:
        while not self._stop.wait(self.interval / 2):
            quiet = time.monotonic() - self._store_ok
            if quiet > self._store_limit() + self.interval:  # the beat thread is stuck in a store call
                self._end(self._store_line())

    def _limit(self) -> float:
        """The silence that ends: ALARM_BEATS beats after a failed collective; during start-up (step 0: until this
        rank's first step is done, or its trainer has resumed a later one) the start-up bound,
        ``parallel.startup_timeout_s`` (``startup_s``), as joining has: a rank's first beats cost a connect and
        several round trips each more than a beat mid-run (its host's name, every peer's), so a slow link that
        mid-run only slows the steps is not declared dead at start-up; the heartbeat's timeout afterwards."""
        if self.alarm.is_set() or self._alarmed:
            return ALARM_BEATS * self.interval
        return max(self.timeout, self.startup_s) if self.step_of() == 0 else self.timeout

    def _store_limit(self) -> float:
        """The store's silence that ends this rank. A rank that watches nothing hears the store answer only every
        POLL-th beat, so its last answer is up to POLL - 1 beats older than a watcher's: it allows those beats
        more, and a watcher, which may also see a peer silent, is the first to name the store. Otherwise the
        non-watchers' earlier line (the same on every host) ended them first and, the store back, a watcher read
        their counters frozen and named them silent instead of the store (tests/cluster/test_heartbeat.py)."""
        return self._limit() + (0 if self.watched else (POLL - 1) * self._period())

    def _period(self) -> float:
        return self.interval / FAST if self.alarm.is_set() or self._alarmed else self.interval

    def _load_hosts(self, store) -> None:
        """The host names a verdict or a store line may need: the watched slice's and the store's (rank 0's); one
        check a beat until they all exist, then one multi_get, once."""
        ranks = sorted({0, *self.watched})
        keys = [f"host/{r}" for r in ranks]
        try:
            if store.check(keys):
                self.hosts.update((r, v.decode()) for r, v in zip(ranks, store.multi_get(keys)))
                self._hosts_loaded = True
        except Exception:  # noqa: BLE001  names are a courtesy; the verdict goes out without them
            pass

    def _verdict(self, store, silent: list[int], failed: bool, quiet_s: float) -> str:
        what = (
            "failed (its own error is printed above)"
            if failed
            else f"silent for {quiet_s:.0f} s (no heartbeat: dead, frozen or cut off)"
        )
        line = (
            f"error: {describe_ranks(silent, self.hosts)} {what} at step {self.step_of()}; ending the job (seen "
            f"first by rank {self.rank} on host {self.hosts.get(self.rank, host_name())}; the last "
            f"checkpoint is intact)"
        )
        try:
            live = self.world - len(silent)  # how many ranks acknowledge it before leaving: _finish
            store.compare_set(LIVE_KEY, "", str(live))
            return store.compare_set("verdict", "", line).decode() or line
        except Exception:  # noqa: BLE001
            return line

    def _store_line(self) -> str:
        """The same line on every host that lost the store (no store to agree through): the store's host and the
        step, no duration: the silence that ends a rank is shorter on a rank whose collective failed first
        (alarmed: ALARM_BEATS beats) than on one still waiting in it, and both end on the same loss. The step is
        each rank's own and can be one apart: a collective can complete on one rank and not on its neighbour (a
        ring all-reduce hands its last chunks on one peer at a time) when the store's host freezes in it."""
        self._store_lost = True
        return (
            f"error: the job's store at {self.store_addr} (host {store_host(self.hosts)}) has stopped answering "
            f"(dead, frozen or cut off) at step {self.step_of()}; ending the job"
        )

    def _end(self, line: str) -> None:
        with self._ending:  # the beat and the guard thread may both decide; one line
            if self._stop.is_set():  # finished meanwhile: a peer or the store going away now is the normal end
                return
            self._finish(line)

    def _finish(self, line: str) -> None:
        self.verdict = line
        report_once(line)
        sys.stdout.flush()
        sys.stderr.flush()
        if not self._store_lost:  # the store stays up until every live rank has the line (verdict.py)
            acknowledge(lambda: connect(self.op_timeout), self.op_timeout, self.interval)
        if self.exit_fn is os._exit:  # a torchrun agent blocked on a frozen store outlives us otherwise
            agentwatch.start(self.op_timeout)
        self.exit_fn(EXIT_CODE)
        self._stop.set()  # exit_fn returned (tests): stop watching
