"""Hang localisation (parallel.hang_timeout_s): a rank that has completed no communication operation and no step for
that long, while its process lives (so the heartbeat sees nothing wrong), starts the hang report; every rank posts
the tail of its operation log (engine/trust/oplog.py) to the job's store, one rank reads them all and prints ONE
line naming the operation the job is stuck in and the rank(s) that never entered it (engine/trust/hangreport.py),
writes the whole table to ``out_dir/hang-<step>.json``, and every rank ends with exit status 5. The main thread is
blocked in a collective, so this thread posts and exits itself (``os._exit`` after flushing, as the heartbeat's
verdict does); the last committed checkpoint stays the last one (a save in progress never commits).

Store traffic (issue 43's rules, O(1) requests per rank at any N): a rank's watch thread never calls the store
while the job makes progress; its listener holds one blocked wait on ``alarm`` for the whole job (its own
connection). On a hang: the first rank to see it sets ``alarm`` (every listener wakes), every rank sets its own
``tail/<rank>`` key and claims ``claim`` (an add); the first claimer, the reporter, waits for the N keys in one
request, reads them in one ``multi_get`` (checking one by one only the keys of ranks that never posted), and sets
``verdict``; the others block on ``verdict``, then count into ``acks`` so that the host serving the store (rank 0
under the deepspeed launcher) never takes it away before every rank has read the verdict.

Allowances: the first step (compilation, warm-up, a resume's first collective) and a checkpoint save get
``max(FIRST_FACTOR * hang_timeout_s, parallel.startup_timeout_s)``. A hang_timeout_s not below parallel.timeout_s
turns the watchdog off (a collective's own timeout would end the job first); rank 0 says so at start.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from engine.cluster.heartbeat import host_name, launch_round, store_address
from engine.cluster.report import report_once
from engine.trust import hangreport, oplog

EXIT_STATUS = 5  # launch/pretrain.py and README "Hang localisation": the job stopped making progress
FIRST_FACTOR = 3  # the first step's and a save's allowance, in hang timeouts
COLLECT_S = 10.0  # how long the reporter waits for every rank's tail (a frozen rank's is the heartbeat's business)
ACK_S = 5.0  # how long a rank waits, after the verdict, for every rank to have read it
LISTEN_S = 86400.0
TAIL = 16  # records a rank posts (the ring keeps oplog.SIZE): ~4 KB a rank, one read of 64 MB at 16,384 ranks
GROUP_NAMES = ("tp", "pp", "dp", "cp", "dp_cp", "mp", "embed", "ep", "edp")


def connect(timeout_s: float):
    """A client of the job's store with a connection of its own, under this launch round's hang keys."""
    import torch.distributed as dist

    store = dist.TCPStore(
        *store_address(), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return dist.PrefixStore(f"engine-hang/{launch_round()}/", store)


def effective_timeout(hang_s: float, collective_s: float, world: int) -> float:
    """The silence that starts a hang report; 0 (off) for one process, when off, or when not below timeout_s."""
    return hang_s if world > 1 and 0 < hang_s < collective_s else 0.0


class HangWatch:
    """One per Trainer: ``start()`` as training starts, ``saving()`` around a checkpoint save, ``stop()`` at its end."""

    def __init__(self, cfg, ctx, exit_fn=os._exit):
        p = cfg.parallel
        self.timeout = effective_timeout(p.hang_timeout_s, p.timeout_s, ctx.world_size)
        self.allowance = max(FIRST_FACTOR * self.timeout, p.startup_timeout_s)
        self.rank, self.world, self.out_dir, self.exit_fn = ctx.rank, ctx.world_size, cfg.train.out_dir, exit_fn
        self.names, self.members = {None: "world"}, {}
        for name in GROUP_NAMES:
            with contextlib.suppress(KeyError):
                self.names.setdefault(ctx.group(name), name)
        self.period = max(0.2, self.timeout / 10)
        self._stop, self._ending, self._saving = threading.Event(), threading.Lock(), False
        self._saves = 0  # saves ended: progress (the silence of a long save is not counted after it)
        self.first_step = 1
        self.line: str | None = None
        oplog.arm(ctx.rank)
        if ctx.rank == 0 and p.hang_timeout_s >= p.timeout_s > 0 and ctx.world_size > 1:
            print(
                f"parallel.hang_timeout_s={p.hang_timeout_s} is not below parallel.timeout_s={p.timeout_s}: the "
                f"hang watchdog is off (a collective's own timeout ends a hang, unnamed)",
                flush=True,
            )

    def start(self, first_step: int) -> "HangWatch":
        """Watch from here on; step ``first_step`` (the start's first) gets the first step's allowance."""
        if self.timeout:
            self.first_step = first_step
            threading.Thread(target=self._watch, name="engine-hang-watch", daemon=True).start()
            threading.Thread(target=self._listen, name="engine-hang-listener", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def saving(self):
        """A checkpoint save: the first step's allowance instead of hang_timeout_s; its end counts as progress."""
        self._saving = True
        try:
            yield
        finally:
            self._saving, self._saves = False, self._saves + 1

    # ---- the threads ---------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        log, mark = oplog.LOG, None
        last = time.monotonic()
        while not self._stop.wait(self.period):
            now, seen = time.monotonic(), (log.done, log.step, self._saves)
            if seen != mark:
                mark, last = seen, now
                continue
            limit = self.allowance if self._saving or log.step <= self.first_step else self.timeout
            if now - last > limit:
                self._hang(detected=True, idle_s=now - last)
                return

    def _listen(self) -> None:
        """Blocks on ``alarm`` (one request for the whole job): another rank saw the hang first."""
        try:
            store = connect(self.allowance)
            while not self._stop.is_set() and not store.check(["alarm"]):
                with contextlib.suppress(Exception):
                    store.wait(["alarm"], timedelta(seconds=LISTEN_S))
        except Exception:  # noqa: BLE001  the store went with the job (it finished): nothing to hear
            return
        if not self._stop.is_set():
            self._hang(detected=False, idle_s=None)

    def _hang(self, detected: bool, idle_s: float | None) -> None:
        if not self._ending.acquire(blocking=False) or self._stop.is_set():
            return
        try:
            store = connect(COLLECT_S + ACK_S)
            if post(store, self.rank, json.dumps(self.tail(idle_s)), detected):
                self.line = self.report(collect(store, self.world))
                store.set("verdict", self.line)
            else:
                with contextlib.suppress(Exception):
                    store.wait(["verdict"], timedelta(seconds=COLLECT_S + ACK_S))
            if not acknowledge(store, self.world):
                store.wait(["all"], timedelta(seconds=ACK_S))
        except Exception:  # noqa: BLE001  the store went (its host ended first): end all the same
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_fn(EXIT_STATUS)

    # ---- what is posted and reported -----------------------------------------------------------------------------
    def tail(self, idle_s: float | None) -> dict:
        """This rank's host, step, schedule position and its last operations, with ages instead of clock times."""
        now, log = time.monotonic(), oplog.LOG
        ops = []
        for seq, kind, group, what, peer, nbytes, step, action, mb, chunk, start, end in log.tail(TAIL):
            ops.append(
                {"seq": seq, "kind": kind, "group": self.group_name(group), "ranks": self.group_ranks(group)}
                | {"what": what, "peer": peer, "bytes": nbytes, "step": step, "action": action, "mb": mb}
                | {"chunk": chunk, "age_s": round(now - start, 3), "open": not end}
                | ({"took_s": round(end - start, 6)} if end else {})
            )
        action, mb, chunk = log.where
        where = {"action": action, "mb": mb, "chunk": chunk}
        return {"host": host_name(), "step": log.step, "where": where, "idle_s": idle_s, "ops": ops}

    def group_name(self, group) -> str:
        return self.names.get(group, "group")

    def group_ranks(self, group) -> list | None:
        """The group's global ranks, ["range", start, stop, step] when they are evenly spaced (every mesh axis'
        group): a dp group of 2,048 ranks is four numbers, not 2,048. None: the world."""
        if group is None:
            return None
        if group not in self.members:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group)
            steps = {b - a for a, b in zip(ranks, ranks[1:])}
            even = len(ranks) > 2 and len(steps) == 1 and steps.pop() > 0
            step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
            self.members[group] = ["range", ranks[0], ranks[-1] + step, step] if even else ranks
        return self.members[group]

    def report(self, tails: dict[int, dict]) -> str:
        """The reporter: the line from every rank's tail, the table on disk."""
        step, line = hangreport.diagnose(tails, self.world)
        path = Path(self.out_dir) / f"hang-{step}.json"
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"step": step, "line": line, "ranks": tails}, indent=1) + "\n")
            os.replace(tmp, path)
            line += f" (every rank's last operations: {path}; exit status {EXIT_STATUS})"
        except OSError as e:
            line += f" (the table could not be written to {path}: {e.strerror}; exit status {EXIT_STATUS})"
        report_once(line)
        return line


# ---- the store protocol (tests/trainer/test_hang.py counts it at 1,024 simulated ranks) ----------------------------
def post(store, rank: int, tail: str, detected: bool) -> bool:
    """A rank's post: the alarm (the rank that saw the hang itself: wakes every listener), its tail, and its claim;
    True for the first claimer, the reporter. Two or three requests."""
    if detected:
        store.set("alarm", str(rank))
    store.set(f"tail/{rank}", tail)
    return detected and store.add("claim", 1) == 1


def collect(store, world: int) -> dict[int, dict]:
    """The reporter: every rank's tail that came within COLLECT_S, in one wait and one multi_get (one check per key
    only when some rank never posted)."""
    keys = [f"tail/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=COLLECT_S))
        present = list(range(world))
    except Exception:  # noqa: BLE001  some rank never posted (frozen, dead): the heartbeat names it
        present = [r for r in range(world) if store.check([keys[r]])]
    return {r: json.loads(v) for r, v in zip(present, store.multi_get([keys[r] for r in present]))}


def acknowledge(store, world: int) -> bool:
    """Count this rank in after the verdict; True for the last one, which sets ``all`` (the others wait on it)."""
    if store.add("acks", 1) >= world:
        store.set("all", "1")
        return True
    return False
