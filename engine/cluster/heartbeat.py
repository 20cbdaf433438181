"""Heartbeat and watchdog: a rank whose peer has gone silent ends itself within ``parallel.heartbeat_timeout_s``,
naming the peer, whatever the main thread is blocked in (a collective, a pipeline recv, a checkpoint write).

A collective's own timeout (``parallel.timeout_s``) must stay long enough for the biggest all-gather or the
slowest checkpoint barrier, so it cannot also be what notices a frozen host (SIGSTOP, a hung driver) or a
partition: that costs the whole ``timeout_s``, then a traceback from every rank. Here a daemon thread per rank
talks to the job's c10d store (MASTER_ADDR:MASTER_PORT, its own client connection) every ``timeout / BEATS``
seconds: it bumps its own counter ``hb/<rank>`` (with the current step) and reads everyone else's in one
``multi_get``. A peer whose counter has not moved for ``timeout`` seconds of *this* rank's clock
(no clock is compared across hosts) is silent: the first rank to see it posts one line to ``verdict`` (compare-set,
so every rank reports the same line), prints it once per host (engine/cluster/report.py), and leaves with
``os._exit`` (a thread cannot unblock a collective; the checkpoint on disk stays the last committed one). A store
that stops answering for ``timeout`` seconds is reported as such, naming the host that serves it, and ends the
rank too; a second thread that never calls the store sees it when a store call hangs (a frozen or cut store host
never answers, and the client's timeout does not bound waiting for a reply). A rank that finishes writes ``done``
and is never called silent; one that fails on its own writes ``failed`` and is named at once.

After the main thread saw a collective fail (``explain``: a killed peer closes its sockets, gloo fails within
seconds), the silence needed drops to ``ALARM_BEATS`` beats, so a dead peer is named in seconds, in one line.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta

from engine.cluster.report import report_once
from engine.errors import ConfigError

BEATS = 10  # beats per timeout: a silent peer is seen between timeout and timeout + timeout / BEATS
ALARM_BEATS = 3  # after a failed collective: beats of silence that name a peer dead
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


def namespace() -> str:
    """Keys of this launch round: a torchrun restart shares the agent's store with the dead round."""
    return f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


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


def describe_ranks(ranks: list[int], hosts: dict[int, str]) -> str:
    """'rank 3 on host b (10.0.0.2)', 'ranks 2, 3 on host b (...)' grouped per host."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(hosts.get(r, "an unknown host"), []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on host {h}" for h, rs in by_host.items()]
    return "; ".join(parts)


class Heartbeat:
    """One rank's beat and watchdog thread. ``step`` is read from ``step_of()`` (the trainer's step) at each beat."""

    def __init__(self, rank: int, world: int, timeout_s: float, step_of=lambda: 0, exit_fn=os._exit):
        self.rank, self.world, self.timeout = rank, world, timeout_s
        self.interval = max(0.2, timeout_s / BEATS)
        # a store operation waits this long at most: a frozen store is named within timeout + op_timeout + interval
        self.op_timeout = max(self.interval, timeout_s / 3)
        self.step_of, self.exit_fn = step_of, exit_fn
        self.hosts: dict[int, str] = {}
        self.verdict: str | None = None  # the line this rank ended with
        self.alarm = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-heartbeat", daemon=True)
        # A store call never returns while the store's host is frozen or cut off (the client's timeout bounds
        # waiting for a key, not for the server's reply): a second thread, which never calls the store, watches
        # the first one's last answered beat.
        self._guard_thread = threading.Thread(target=self._guard, name="engine-heartbeat-guard", daemon=True)
        self._store_ok = time.monotonic()
        self._ending = threading.Lock()
        self.store_addr = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}"

    def start(self) -> "Heartbeat":
        self._thread.start()
        self._guard_thread.start()
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
        while not self._stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)

    # ---- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        store, me = None, host_name()
        keys = [f"hb/{r}" for r in range(self.world)] + ["verdict"]
        last: dict[int, str] = {}
        now = time.monotonic()
        seen = {r: now for r in range(self.world)}
        beat = 0
        while not self._stop.wait(0 if beat == 0 else self.interval):
            beat += 1
            now = time.monotonic()
            try:
                if store is None:
                    store = connect(self.op_timeout)
                    store.set(f"host/{self.rank}", me)
                    store.compare_set("verdict", "", "")  # exists from now on: multi_get never waits for it
                store.set(f"hb/{self.rank}", f"{beat} {self.step_of()}")
                values = self._read(store, keys)
                self._store_ok = now
            except Exception:  # noqa: BLE001  unreachable, reset, timed out: the same to us
                # The same client tries again next beat: a new one per beat would dump a C++ stack trace per beat
                # into the log while the store is away, and one that never connected tries to connect again.
                now = time.monotonic()
                if now - self._store_ok > self._limit():
                    self._end(self._store_line(now - self._store_ok))
                continue
            if values[-1]:
                self._end(values[-1])
            if len(self.hosts) < self.world:  # every rank set host/ before its first beat
                self._load_hosts(store)
            for r, v in enumerate(values[:-1]):
                if v != last.get(r):
                    last[r], seen[r] = v, now
            failed = [r for r in range(self.world) if last.get(r) == "failed"]
            silent = failed or [r for r in range(self.world) if last.get(r) != "done" and now - seen[r] > self._limit()]
            if silent:
                self._end(self._verdict(store, silent, bool(failed), now - min(seen[r] for r in silent)))

    def _guard(self) -> None:
        while not self._stop.wait(self.interval / 2):
            quiet = time.monotonic() - self._store_ok
            if quiet > self._limit() + self.interval:  # the beat thread is stuck in a store call
                self._end(self._store_line(quiet))

    @staticmethod
    def _read(store, keys: list[str]) -> list[str | None]:
        """Every key's value in one round trip once all exist; until then (start-up) key by key, None where absent
        (multi_get would wait for it): a rank that never beats is silent from the start."""
        if store.check(keys):
            return [v.decode() for v in store.multi_get(keys)]
        return [store.get(k).decode() if store.check([k]) else None for k in keys]

    def _limit(self) -> float:
        return ALARM_BEATS * self.interval if self.alarm.is_set() else self.timeout

    def _load_hosts(self, store) -> None:
        missing = [r for r in range(self.world) if r not in self.hosts]
        try:
            present = [r for r in missing if store.check([f"host/{r}"])]
            for r, v in zip(present, store.multi_get([f"host/{r}" for r in present]) if present else []):
                self.hosts[r] = v.decode()
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
            return store.compare_set("verdict", "", line).decode() or line
        except Exception:  # noqa: BLE001
            return line

    def _store_line(self, quiet_s: float) -> str:
        holder = self.hosts.get(0, "that of rank 0")
        return (
            f"error: the job's store at {self.store_addr} (host {holder}) has not answered for {quiet_s:.0f} s "
            f"(dead, frozen or cut off) at step {self.step_of()}; ending rank {self.rank} on host {host_name()}"
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
        self.exit_fn(EXIT_CODE)
        self._stop.set()  # exit_fn returned (tests): stop watching
