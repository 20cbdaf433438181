"""Hang localisation (parallel.hang_timeout_s, engine/trust/hang.py) through launch/pretrain.py: four ranks, each a
fork of this process running the launcher as torchrun would start it (RANK, WORLD_SIZE, MASTER_* set; rank 0 serves
the job's store, as under the deepspeed launcher), with one fault injected through ENGINE_TEST_HANG (read by
engine/trust/oplog.py, acted on by the real executor and trainer code): a rank sleeping inside a stage's forward,
a rank skipping the loss all-reduce over dp, a pipeline receive from a rank that never sends it. Each job must end
within hang_timeout_s + 30 s, every rank with exit status 5, in ONE ``error: hang`` line naming the right rank and
operation, with out_dir/hang-<step>.json holding every rank's table, and the last committed checkpoint intact."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.testing._internal.distributed.fake_pg import FakeStore

from engine.config import Config
from engine.trust import hang, oplog
from engine.trust.hang import EXIT_STATUS, HangWatch, acknowledge, collect, effective_timeout, post
from launch.bench.scale_store import Counting, start_server
from tests.cli import ROOT, _child, run_script
from tests.dist import free_port
from tests.shrunk import FIVE_STEPS

HANG_S = 3
BOUND_S = HANG_S + 30  # the bound, from the fault (step 3 begins within seconds of the start)
START_S = 60  # imports are already done in the fork; joining the store, building the model: a loaded machine


def fork_world(world: int, args: list[str], env: dict) -> list[int]:
    """Fork ``world`` ranks of ``python launch/pretrain.py args``; their pids (output in env's OUT folder)."""
    port, pids = free_port(), []
    for rank in range(world):
        rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        rank_env |= {"LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        out = os.open(Path(env["OUT"]) / f"{rank}.log", os.O_CREAT | os.O_WRONLY, 0o644)
        pid = os.fork()
        if pid == 0:
            tempfile.tempdir = env["TMPDIR"]  # report_once's marker: this job's, not the session's (same parent)
            _child("launch/pretrain.py", args, ROOT, rank_env, out, out, os.open(os.devnull, os.O_RDONLY), False)
        os.close(out)
        pids.append(pid)
    return pids


def wait_all(pids: list[int], timeout: float) -> list[int | None]:
    """Exit statuses by rank; None for a rank still running at ``timeout`` (then killed)."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(done[1])
        time.sleep(0.05)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return [codes.get(pid) for pid in pids]


def hang_run(tmp_path: Path, fault: str, *layout: str) -> tuple[list, str, Path]:
    """(exit statuses, every rank's output, out_dir) of a 6-step run with ``fault`` (ENGINE_TEST_HANG) at step 3."""
    out, ckpt, logs = tmp_path / "run", tmp_path / "ckpt", tmp_path / "logs"
    logs.mkdir()
    args = [*FIVE_STEPS, "--train.steps", "6", "--train.out_dir", str(out), "--train.global_batch_size", "8"]
    args += ["--train.micro_batch_size", "2", "--parallel.hang_timeout_s", str(HANG_S)]
    args += ["--checkpoint.dir", str(ckpt), "--checkpoint.every", "2", *layout]
    env = {**os.environ, "ENGINE_TEST_HANG": fault, "OUT": str(logs), "OMP_NUM_THREADS": "1"}
    env["TMPDIR"] = tempfile.mkdtemp(dir=tmp_path)
    started = time.monotonic()
    codes = wait_all(fork_world(4, args, env), START_S + BOUND_S)
    text = "\n".join((logs / f"{r}.log").read_text() for r in range(4))
    assert time.monotonic() - started < START_S + BOUND_S, text[-4000:]
    return codes, text, out


def the_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: hang at step 3: "), text[-4000:]
    return lines[0]


CASES = {
    # rank 1 (stage 0, tp rank 1) sleeps in a forward: its tp peer waits in the layer's all-reduce over tp
    "sleep_forward": (
        ["--parallel.tp", "2", "--parallel.pp", "2"],
        r"(rank 0 on host .* in all-reduce over tp \(layer; micro-batch 0, action F\)|rank 3 on host .* in recv from "
        r"rank 1 over pp \(micro-batch 0, action recv F\)); rank 1 on host .* never (entered|sent) it: rank 1 is in "
        r"its forward \(micro-batch 0, action F\) for \d+ s, in no communication",
    ),
    # rank 1 (stage 0, dp rank 1) skips step 3's agreement all-reduce over the world: the others wait in it, rank 1
    # went on to the grad norm's over mp (with rank 3, which waits in the agreement)
    "skip_collective": (
        ["--parallel.pp", "2", "--parallel.schedule", "interleaved", "--parallel.virtual_stages", "2"]
        + ["--model.num_layers", "4"],
        r"(rank 1 on host .* in all-reduce over mp \(grad norm\); rank 3 on host .* never entered it( \(the ranks wait "
        r"for each other in a cycle\))?: rank 3 waits in all-reduce over world \(step agreement\)|rank [023] on host "
        r".* in all-reduce over world \(step agreement\); rank 1 on host .* never entered it( \(the ranks wait for "
        r"each other in a cycle\))?: rank 1 waits in all-reduce over mp \(grad norm\))",
    ),
    # rank 2 (stage 1, dp rank 0) receives its forward input from rank 1 (over the world group), which never sends it
    "wrong_peer": (
        ["--parallel.pp", "2"],
        r"rank 2 on host .* in recv from rank 1 over world \(micro-batch 0, action recv F\); rank 1 on host .* never "
        r"sent it",
    ),
}


# sleep_forward at tp 2 x pp 2 runs in CI across two hosts (tests/cluster/test_hang_hosts.py): here it is slow
@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=[pytest.mark.slow] if f == "sleep_forward" else []) for f in CASES]
)
def test_hang_is_named(tmp_path, fault):
    layout, pattern = CASES[fault]
    rank = {"wrong_peer": 2}.get(fault, 1)
    codes, text, out = hang_run(tmp_path, f"{fault}:{rank}:3", *layout)
    assert codes == [EXIT_STATUS] * 4, (codes, text[-4000:])
    line = the_line(text)
    assert re.search(pattern, line), line
    table = json.loads((out / "hang-3.json").read_text())
    assert table["line"] in line and sorted(table["ranks"]) == ["0", "1", "2", "3"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_000002"]


def test_negative_hang_timeout_refused():
    r = run_script("launch/pretrain.py", *FIVE_STEPS, "--parallel.hang_timeout_s", "-1")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: parallel.hang_timeout_s=-1.0 must be >= 0 (0 turns the hang watchdog off; it must be below "
        "parallel.timeout_s=600.0 to act)"
    ], r.stderr


def test_the_watchdog_acts_only_below_the_collective_timeout_and_with_peers():
    """hang_timeout_s acts when it is below parallel.timeout_s (at it, a collective's own timeout ends the job
    first: rank 0 says the watchdog is off) and there is another rank; 0 turns it off."""
    assert [effective_timeout(h, 600.0, 4) for h in (0.0, 3.0, 599.0, 600.0, 900.0)] == [0.0, 3.0, 599.0, 0.0, 0.0]
    assert effective_timeout(3.0, 600.0, 1) == 0.0 and effective_timeout(3.0, 600.0, 2) == 3.0


def protocol_counts(world: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The hang report's store protocol (engine/trust/hang.py post, collect, acknowledge) run for ``world``
    simulated ranks against a real TCPStore, each rank on a client that counts its requests and keys (issue 43's
    rule: O(1) requests per rank; one rank reads N keys): ([(requests, keys)] of the other ranks, the reporter's)."""
    server, port, stop = start_server()
    try:
        raw = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        stores = [Counting(PrefixStore("engine-hang/0/", raw)) for _ in range(world)]
        tail = json.dumps({"host": "h", "step": 3, "where": {}, "idle_s": None, "ops": []})
        assert post(stores[0], 0, tail, detected=True)  # rank 0 saw it: the alarm, then the reporter
        assert not any(post(stores[r], r, tail, detected=False) for r in range(1, world))
        assert sorted(collect(stores[0], world)) == list(range(world))
        stores[0].set("verdict", "error: hang")
        for store in stores[1:]:
            store.wait(["verdict"])
        last = [acknowledge(store, world) for store in stores]
        assert last == [False] * (world - 1) + [True]
        for store in stores[:-1]:
            store.wait(["all"])
    finally:
        stop()
    return [(s.requests, s.keys) for s in stores[1:]], (stores[0].requests, stores[0].keys)


def test_the_report_costs_each_rank_the_same_requests_at_1024_ranks_as_at_64():
    small, large = protocol_counts(64), protocol_counts(1024)
    assert set(small[0]) == set(large[0]) == {(4, 4)}  # tail, verdict, ack, all (the last rank: sets all)
    assert small[1][0] == large[1][0] == 8  # the reporter: + alarm, claim, one wait and one read of N keys
    assert (small[1][1] - 2 * 64, large[1][1] - 2 * 1024) == (6, 6)


class Impatient(Counting):
    """A counting client whose waits run out after 50 ms instead of the timeout asked (the store's own error, as
    when COLLECT_S passes): a rank that never posts costs the test no wait."""

    def wait(self, keys, timeout=None):
        return super().wait(keys, timedelta(milliseconds=50))


def test_a_rank_that_never_posted_is_left_out_and_the_others_reported():
    """The reporter's wait for every rank's tail runs out when a rank never posts (frozen, dead: the heartbeat
    names it): the others' tails are still read (one request after a check a key) for the report;
    the rank that never posted is not in the table."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    keys = Impatient(PrefixStore("engine-hang/0/", store))
    for rank in (0, 2):
        post(keys, rank, json.dumps({"step": 3, "rank": rank}), detected=rank == 0)
    requests = keys.requests
    assert collect(keys, 3) == {0: {"step": 3, "rank": 0}, 2: {"step": 3, "rank": 2}}
    assert keys.requests - requests == 1 + 3 + 1  # the wait that ran out, a check a key, one multi_get


class Ctx:
    """A rank's place: its process groups by axis name (hang.py asks ``group`` for each; KeyError: no such axis)."""

    def __init__(self, rank: int, world: int, groups: dict | None = None):
        self.rank, self.world_size, self.groups = rank, world, groups or {}

    def group(self, name: str):
        return self.groups[name]


def watches(
    tmp_path: Path, monkeypatch, ranks: list[tuple[int, float]], port: int = 0, world: int = 2
) -> tuple[list, list, TCPStore | None]:
    """Ranks of a job of ``world`` (rank, hang_timeout_s), in this process on a store of its own (or the one at
    ``port``), 600 s of start-up allowance: their exit statuses land in the returned list instead of ending the
    process, with the count of ranks that read the verdict when they end."""
    store = None
    if not port:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        port = store.port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "1")  # report_once prints directly (no marker file shared with other tests)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", oplog.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(oplog, "LOG", oplog.OpLog())
    exits, made = [], []

    acks = store and PrefixStore("engine-hang/0/", store)

    def exit_(rank: int, status: int) -> None:
        exits.append((rank, status, time.monotonic(), acks.add("acks", 0) if acks else None))

    for rank, hang_s in ranks:
        cfg = Config()
        cfg.parallel.hang_timeout_s, cfg.parallel.startup_timeout_s = hang_s, 600.0
        cfg.train.out_dir = str(tmp_path)
        made.append(HangWatch(cfg, Ctx(rank, world), exit_fn=lambda status, rank=rank: exit_(rank, status)))
    return made, exits, store


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_silent_rank_reports_the_hang_and_every_rank_ends_with_its_status(tmp_path, monkeypatch, capsys):
    """In process, on a real store: no operation ends for hang_timeout_s on rank 0, past its first step; rank 0
    raises the alarm, rank 1's listener hears it and posts its tail, rank 0 reports the operation both wait in,
    writes the table, and both exit with status 5. The first step and a save get the allowance instead (a silence
    of two timeouts there ends nothing), and a save's end is progress (the silence before it is not counted after
    it). A table that cannot be written is named in the line instead."""
    (saving, reporter, listener), exits, store = watches(tmp_path, monkeypatch, [(0, 0.5), (0, 0.5), (1, 599.0)])
    # the rule: the first step and a save get max(3 hang timeouts, startup_timeout_s); a look every tenth of the
    # timeout, at most five a second
    assert [(w.timeout, w.allowance, w.period) for w in (reporter, listener)] == [
        (0.5, 600.0, 0.2),
        (599.0, 1797.0, 59.9),
    ]
    keys, log = PrefixStore("engine-hang/0/", store), oplog.LOG  # this launch round's keys, as hang.connect names them
    log.step = 5
    with saving.saving():  # a save past the first step: two timeouts of silence end nothing
        saving.start(first_step=4)
        time.sleep(1.0)
        saving.stop()
    log.step = 4
    log.end(log.begin("all-reduce", None, "loss", 4))
    for watch in (reporter, listener):
        watch.start(first_step=4)
    threads = [t for t in threading.enumerate() if t.name.startswith("engine-hang")]
    assert len(threads) >= 4 and all(t.daemon for t in threads)  # a crash of the main thread still ends the process
    time.sleep(1.0)  # the same in the first step
    assert exits == [] and not keys.check(["alarm"])
    log.step = 5  # step 4 done
    with reporter.saving():  # a save longer than hang_timeout_s: its end is the last progress
        time.sleep(1.0)
        quiet = time.monotonic()
    log.begin("all-reduce", None, "step agreement", 16)  # never ends
    assert wait_for(lambda: len(exits) == 2, 60), exits
    assert sorted(e[:2] for e in exits) == [(0, EXIT_STATUS), (1, EXIT_STATUS)]
    assert min(e[2] for e in exits) > quiet + 0.5  # nothing before hang_timeout_s of silence after the save
    line = reporter.line
    assert (
        line.startswith("error: hang at step 5: 2 of 2 ranks wait in communication") and line in capsys.readouterr().err
    )
    assert f"(every rank's last operations: {tmp_path / 'hang-5.json'}; exit status 5)" in line
    table = json.loads((tmp_path / "hang-5.json").read_text())
    assert table["line"] in line and sorted(table["ranks"]) == ["0", "1"] and listener.line is None
    for rank, tail in table["ranks"].items():
        assert tail["step"] == 5 and tail["where"] == {"action": "", "mb": -1, "chunk": 0}, tail
        done, waiting = tail["ops"]
        assert done["open"] is False and done["what"] == "loss" and done["step"] == 4
        # its duration, within its age: the line's "for N s" of a rank in no communication is age_s - took_s
        assert 0 <= done["took_s"] <= done["age_s"] and done["age_s"] - done["took_s"] >= waiting["age_s"]
        assert waiting["open"] is True and "took_s" not in waiting and 0.5 <= waiting["age_s"] < 60
        assert (waiting["group"], waiting["ranks"], waiting["bytes"], waiting["what"]) == (
            "world",
            None,
            16,
            "step agreement",
        )
    idle = [tail["idle_s"] for _, tail in sorted(table["ranks"].items())]
    assert 0.5 < idle[0] < 5.0 and idle[1] is None  # rank 0 saw the silence itself (within ten looks), rank 1 was told
    assert keys.get("verdict").decode() == line and keys.get("alarm") == b"0" and keys.add("acks", 0) == 2
    for watch in (reporter, listener):
        watch.stop()
    reporter.out_dir = str(tmp_path / "gone")
    again = reporter.report({int(rank): tail for rank, tail in table["ranks"].items()})
    assert again.startswith(table["line"]) and again.endswith(
        f"(the table could not be written to {tmp_path / 'gone' / 'hang-5.json'}: No such file or directory; "
        "exit status 5)"
    )


def test_no_rank_ends_before_every_rank_read_the_verdict(tmp_path, monkeypatch):
    """A job of three: rank 0 reports a hang, rank 1 hears it, rank 2 (this test, through hang.py's own protocol
    functions) posts its tail and reads the verdict last: neither watch ends before it counted in, as the rank
    serving the store (rank 0 under the deepspeed launcher) must not take it away from a rank still reading."""
    watching, exits, store = watches(tmp_path, monkeypatch, [(0, 0.5), (1, 599.0)], world=3)
    keys, tail = PrefixStore("engine-hang/0/", store), {"host": "h", "step": 5, "where": {}, "idle_s": None}
    oplog.LOG.step = 5
    for watch in watching:
        watch.start(first_step=4)
    assert wait_for(lambda: keys.check(["alarm"]), 60)
    assert not post(keys, 2, json.dumps(tail | {"ops": []}), detected=False)
    keys.wait(["verdict"])
    assert wait_for(lambda: keys.add("acks", 0) == 2, 60)
    time.sleep(0.2)  # the others counted in: they wait for this rank
    assert exits == []
    assert acknowledge(keys, 3)  # the last: sets "all"
    assert wait_for(lambda: len(exits) == 2, 60) and sorted(e[:2] + e[3:] for e in exits) == [(0, 5, 3), (1, 5, 3)]
    for watch in watching:
        watch.stop()


def test_a_rank_waits_for_the_verdict_longer_than_the_reporter_waits_for_the_tails(tmp_path, monkeypatch):
    """A rank that is not the reporter waits for the verdict longer than the reporter may wait for every rank's tail
    (a frozen rank's never comes): one that gave up sooner would count in and end before the verdict, and on the
    rank serving the store take the store away from the reporter still collecting: the job would end unnamed.
    Each wait's timeout is read as hang.py passes it to the real store (no wait runs out: a job of two)."""
    waits, connect = [], hang.connect

    class Recording(Counting):
        def wait(self, keys, timeout=None):
            waits.append((keys[0], timeout))
            return super().wait(keys, timeout)

    monkeypatch.setattr(hang, "connect", lambda timeout_s: Recording(connect(timeout_s)))
    watching, exits, _ = watches(tmp_path, monkeypatch, [(0, 0.5), (1, 599.0)])
    oplog.LOG.step = 5
    for watch in watching:
        watch.start(first_step=4)
    assert wait_for(lambda: len(exits) == 2, 60), exits
    for watch in watching:
        watch.stop()
    timeout = dict(waits)
    assert timeout["verdict"] > timeout["tail/0"], waits  # rank 1 waits for rank 0's verdict, rank 0 for the tails


def watch_until_the_store_goes(tmp_path: Path, monkeypatch, rank: int, hang_s: float) -> tuple:
    """Rank ``rank`` of two past its first step on a store in a process of its own, killed once the rank's listener
    is connected (rank 1) or its hang report posted its tail (rank 0: the report then waits for rank 1's tail, which
    never comes): (the watch, its exit statuses, its listener thread)."""
    server, port, _ = start_server()
    raw = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    keys = PrefixStore("engine-hang/0/", raw)
    (watch,), exits, _ = watches(tmp_path, monkeypatch, [(rank, hang_s)], port=port)
    oplog.LOG.step = 5
    before = set(threading.enumerate())
    watch.start(first_step=4)
    listener = next(t for t in set(threading.enumerate()) - before if t.name == "engine-hang-listener")
    me = psutil.Process()
    connected = lambda: sum(1 for c in me.net_connections("tcp") if c.raddr and c.raddr.port == port) == 2  # noqa: E731
    assert wait_for(lambda: keys.check(["tail/0"]) if rank == 0 else connected(), 60), rank
    server.kill()
    server.join()
    return watch, exits, listener


def test_a_store_that_goes_away_ends_a_listener_quietly_and_a_report_with_its_status(tmp_path, monkeypatch):
    """The job's store can go before a rank ends (its host finished first, or died): a listener then ends without
    a word (no traceback after a job that finished), and a rank reporting a hang ends with status 5 all the same,
    not left in its collective until parallel.timeout_s."""
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)  # what would print a thread's traceback
    quiet, exits, listener = watch_until_the_store_goes(tmp_path, monkeypatch, 1, 599.0)
    listener.join(60)
    assert not listener.is_alive() and exits == [] and uncaught == [], (exits, uncaught)
    reporter, exits, _ = watch_until_the_store_goes(tmp_path, monkeypatch, 0, 0.5)
    assert wait_for(lambda: exits, 30) and [e[:2] for e in exits] == [(0, EXIT_STATUS)] and uncaught == [], uncaught
    quiet.stop()
    reporter.stop()


def test_rank_0_alone_says_when_the_watchdog_is_off(capsys):
    """A hang_timeout_s not below parallel.timeout_s turns the watchdog off: rank 0 says so, once per job; a
    watchdog that acts, or one process, says nothing."""
    said = []
    cases = [(600.0, 600.0, 0, 2), (1.0, 1.0, 0, 2), (600.0, 600.0, 1, 2), (900.0, 600.0, 0, 1), (599.0, 600.0, 0, 2)]
    for hang_s, timeout_s, rank, world in [*cases, (0.0, 600.0, 0, 2)]:
        cfg = Config()
        cfg.parallel.hang_timeout_s, cfg.parallel.timeout_s = hang_s, timeout_s
        HangWatch(cfg, Ctx(rank, world))
        said.append(capsys.readouterr().out)
    assert said[:2] == [
        f"parallel.hang_timeout_s={s} is not below parallel.timeout_s={s}: the hang watchdog is off (a "
        "collective's own timeout ends a hang, unnamed)\n"
        for s in (600.0, 1.0)  # a collective timeout of a second is a timeout too
    ]
    assert said[2:] == [""] * 4


def test_a_group_is_posted_by_name_and_its_ranks_in_four_numbers_when_evenly_spaced():
    """The operations' groups in a rank's tail: the axis' name (the first of two names for one group, dp before
    dp_cp), "group" for another; the members as ["range", start, stop, step] when evenly spaced (a dp group of 2,048
    ranks is four numbers), else the list. Rank 1 of eight under torch's fake process group: real group objects
    and get_process_group_ranks, no communication."""
    dist.init_process_group("fake", rank=1, world_size=8, store=FakeStore())
    try:
        dp, tp, pp, ep, three = (dist.new_group(r) for r in ([1, 3, 5, 7], [1, 5], [1], [1, 2, 4], [1, 3, 5]))
        watch = HangWatch(Config(), Ctx(1, 8, {"tp": tp, "pp": pp, "dp": dp, "dp_cp": dp, "ep": ep}))
        groups = (None, dist.group.WORLD, dp, tp, pp, ep, three)
        assert [watch.group_name(g) for g in groups] == ["world", "group", "dp", "tp", "pp", "ep", "group"]
        ranks = [["range", 0, 8, 1], ["range", 1, 9, 2], [1, 5], [1], [1, 2, 4], ["range", 1, 7, 2]]
        assert [watch.group_ranks(g) for g in groups] == [None, *ranks]
        assert [watch.group_ranks(g) for g in groups] == [None, *ranks]  # the second time from what it kept
    finally:
        dist.destroy_process_group()
