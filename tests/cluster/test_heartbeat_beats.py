"""The heartbeat's judgement counted in beats, not waited for (issue 45): a job's ranks in this process, each a
``Heartbeat`` that is not started (no threads), on its own client of a real TCPStore; a beat is the engine's own
``exchange`` and ``judge`` at a clock the test sets. So the thresholds (the timeout, the start-up bound, the few
beats after a failed collective) are checked to the beat in well under a second, whatever the machine's load;
tests/cluster/test_heartbeat.py runs the same code on its threads with real silences (SIGSTOP)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from engine.cluster import heartbeat
from engine.cluster.heartbeat import (
    BEATS,
    POLL,
    Heartbeat,
    connect,
    describe_ranks,
    launch_round,
    slice_size,
    store_address,
    watched,
)
from engine.cluster.verdict import ACKS_KEY, LIVE_KEY, acknowledge, store_host
from engine.errors import ConfigError
from launch.bench.scale_store import Counting
from tests.cli import ROOT
from tests.dist import run_threads

TIMEOUT = 2.0  # a beat every 0.2 s; a verdict's acknowledgement waits at most 2 beats + TIMEOUT / 3
BEAT = TIMEOUT / BEATS


@pytest.fixture
def store(monkeypatch):
    """Serves a job's store in this process (a new one per job); MASTER_ADDR and MASTER_PORT name it as a
    launcher would."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    servers = []

    def serve():
        servers.append(
            dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        )
        monkeypatch.setenv("MASTER_PORT", str(servers[-1].port))

    return serve


class Job:
    """``world`` ranks' heartbeats (``local`` ranks per host), at step ``step`` (mutable: ``job.step``), on a new
    store served by ``serve``."""

    def __init__(self, serve, world: int, local: int = 1, step: int = 5, startup_s: float = 0.0):
        serve()
        self.step = step
        self.codes: list[list[int]] = [[] for _ in range(world)]
        self.ranks = [
            Heartbeat(r, world, TIMEOUT, lambda: self.step, self.codes[r].append, local=local, startup_s=startup_s)
            for r in range(world)
        ]
        # the ranks' clients wait long for a reply (a loaded machine); the engine's own clients keep their timeouts
        self.stores = [connect(30.0) for _ in self.ranks]
        for b, s in zip(self.ranks, self.stores):
            b.enter(s)

    def beat(self, at: float, ranks=None) -> None:
        """One beat ``at`` beats into the job of ``ranks`` that have not ended, in that order (all, the last first,
        by default: a watcher reads the counters its peers set in the same beat)."""
        for r in reversed(range(len(self.ranks))) if ranks is None else ranks:
            b, s = self.ranks[r], self.stores[r]
            if not b._stop.is_set():
                values, _ = b.exchange(s)
                b.judge(s, values, 1000.0 + at * BEAT)  # a monotonic clock's reading

    def ended(self) -> list[int]:
        return [r for r, codes in enumerate(self.codes) if codes]


def test_a_peer_silent_for_less_than_the_timeout_is_not_named_and_one_silent_past_it_is(store):
    """Mid-run, rank 1's beats stop for 9 of the 10 beats of the timeout (a GIL-holding call, swapping): nothing
    ends; then they stop for good: its watcher names it on the first beat past the timeout, and only then."""
    job = Job(store, 2)
    for t in range(3):
        job.beat(t)
    for t in range(3, 12):  # 9 beats of rank 1's silence
        job.beat(t, ranks=[0])
    job.beat(12)
    assert job.ended() == []
    for t in [*range(13, 22), 21.9]:  # silent since beat 12: up to 9.9 beats
        job.beat(t, ranks=[0])
        assert job.ended() == [], t
    job.beat(22.1, ranks=[0])  # 10.1 beats: past the timeout
    assert job.ended() == [0] and job.codes[0] == [1]
    assert job.stores[0].get(LIVE_KEY) == b"1"  # the ranks it waits for before leaving (verdict.py): itself
    assert re.match(
        r"error: rank 1 on host \S+ \(127\.0\.0\.1\) silent for 2 s \(no heartbeat: dead, frozen or cut off\) at "
        r"step 5; ending the job \(seen first by rank 0 on host \S+ \(127\.0\.0\.1\); the last checkpoint is intact\)$",
        job.ranks[0].verdict,
    ), job.ranks[0].verdict
    assert (
        job.stores[0].check([ACKS_KEY]) and job.stores[0].get(ACKS_KEY) == b"1"
    )  # it counted itself in before leaving: the store stays for the rest
    job.beat(23, ranks=[1])  # the stalled rank goes on: it reads the verdict and ends with the same line
    assert job.codes[1] == [1] and job.ranks[1].verdict == job.ranks[0].verdict


def test_after_a_failed_collective_a_few_beats_of_silence_name_a_peer(store):
    """Rank 1's collective failed (explain): it posts the alarm; the watcher of the silent ranks 2, 3 then needs
    3 beats, not the timeout (README: "3 beats of silence suffice then"), and beats 3 times a beat (its verdict
    within a third of a beat past those 3; not more often: every alarmed rank's store requests a beat grow with
    it). Ranks of one host are named together. Counted in the literal beats the README gives, not the module's
    constants: a constant off by one would move the verdict by a beat, unseen by a test that reads it."""
    job = Job(store, 4, local=2)
    job.beat(0)
    assert job.ranks[0]._period() == BEAT
    job.ranks[1].explain(wait_s=0)
    job.beat(1, ranks=[1, 0])
    assert job.ranks[1]._period() == BEAT / 3 and job.ranks[0]._period() == BEAT / 3  # rank 0 read the alarm
    job.beat(3 - 0.1, ranks=[1, 0])  # ranks 2, 3 silent since beat 0
    assert job.ended() == []
    job.beat(3 + 0.1, ranks=[0, 1])
    assert job.ended() == [0, 1], job.codes  # rank 1 (no watcher) reads the verdict at its alarmed beat
    assert re.match(r"error: ranks 2, 3 on host \S+ \(127\.0\.0\.1\) silent for 1 s", job.ranks[0].verdict)
    assert job.ranks[1].verdict == job.ranks[0].verdict


def test_explain_gives_the_alarm_its_beats_before_calling_the_error_this_ranks(monkeypatch):
    """After a failed collective the trainer asks explain(): it sets the alarm and waits its 3 beats + 3 beats for
    a verdict (which would end the process) before the error is taken as this rank's own: not less (the alarm's
    verdict would be cut off), nor more than one poll longer (a rank's own error would wait for nothing). Counted
    on a clock that only explain's own polls move."""
    clock = [1000.0]
    fake = SimpleNamespace(monotonic=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(heartbeat, "time", fake)
    beat = Heartbeat(0, 2, TIMEOUT)
    beat.explain()
    assert 6 * BEAT <= clock[0] - 1000.0 < 6 * BEAT + 0.1 and beat.alarm.is_set()  # the alarm's 3 beats + 3
    assert beat.verdict is None


def test_without_an_alarm_the_timeout_holds_for_every_watcher(store):
    """An alarm is what shortens the silence: without one, 3 to 9 beats of silence end nothing on any rank."""
    job = Job(store, 4, local=2)
    job.beat(0)
    for t in range(1, 10):
        job.beat(t, ranks=[0, 1])
    assert job.ended() == [] and job.ranks[0]._period() == BEAT


def test_a_late_first_beat_is_allowed_the_startup_bound_and_not_more(store):
    """At step 0 a rank that has not beaten yet is allowed ``startup_s`` (parallel.startup_timeout_s); past it,
    it is named (its counter never existed); after the first step only the timeout holds."""
    job = Job(store, 2, step=0, startup_s=3 * TIMEOUT)
    job.stores[1].delete_key("hb/1")  # rank 1 is still connecting: only its host name is there
    assert job.ranks[0].exchange(job.stores[0])[1]  # the store answered (only a peer is missing)
    for t in [0, 20, 29.9]:
        job.beat(t, ranks=[0])
    assert job.ended() == []
    job.beat(30.1, ranks=[0])
    assert job.ended() == [0]
    assert re.match(r"error: rank 1 on host .* silent for 6 s .* at step 0", job.ranks[0].verdict), job.ranks[0].verdict

    job = Job(store, 2, step=7, startup_s=3 * TIMEOUT)
    job.stores[1].delete_key("hb/1")
    job.beat(0, ranks=[0])
    job.beat(10.1, ranks=[0])
    assert job.ended() == [0] and "at step 7" in job.ranks[0].verdict


def test_a_peer_that_started_late_is_watched_from_its_first_beat(store):
    """A counter that appears within the start-up bound is watched from then on: beating, it is never named."""
    job = Job(store, 2, step=0, startup_s=3 * TIMEOUT)
    job.stores[1].delete_key("hb/1")
    job.beat(0, ranks=[0])
    job.beat(15, ranks=[0])
    for t in range(16, 50):
        job.beat(t)
    assert job.ended() == []


def test_a_finished_peer_is_never_silent_and_a_failed_one_is_named_at_once(store):
    """A rank that stops tells its peers: ``done`` is never silent, ``failed`` is named at the next beat."""
    job = Job(store, 2)
    job.beat(0, ranks=[0])
    job.stores[1].set("hb/1", "done")  # what Heartbeat.stop tells its peers
    for t in range(1, 30):
        job.beat(t, ranks=[0])
    assert job.ended() == []

    job = Job(store, 2)
    job.beat(0, ranks=[0])
    job.stores[1].set("hb/1", "failed")
    job.beat(0.5, ranks=[0])
    assert job.ended() == [0]
    assert re.match(
        r"error: rank 1 on host .* failed \(its own error is printed above\) at step 5", job.ranks[0].verdict
    )


def test_the_watcher_that_posts_second_reports_the_first_ones_line(store):
    """Both watchers see a silent peer (rank 3 and rank 1) in the same beat: the verdict is compare-set, so both
    print the first poster's line; a rank that watches nothing reads it at its next polling beat (every POLL-th)."""
    job = Job(store, 4, local=2)
    job.beat(0)
    for t in range(1, 10):
        job.beat(t, ranks=[0, 2])
    reads = {r: job.ranks[r].exchange(job.stores[r])[0] for r in (0, 2)}  # both read before either posts
    for r in (0, 2):  # rank 3 silent since beat 0, rank 1 since beat 1 (rank 2 read before rank 1 beat 0)
        job.ranks[r].judge(job.stores[r], reads[r], 1000.0 + 11.1 * BEAT)
    assert job.ended() == [0, 2] and job.ranks[2].verdict == job.ranks[0].verdict
    assert re.match(r"error: rank 3 on host \S+ \(127\.0\.0\.1\) silent", job.ranks[0].verdict), job.ranks[0].verdict
    # rank 3's beats so far: 1 (beat 0); 2 and 3 are not polling beats; 4 is
    for beat in range(2, 5):
        job.beat(10 + beat, ranks=[3])
        assert job.ended() == ([0, 2, 3] if beat == 4 else [0, 2]), beat
    assert job.ranks[3].verdict == job.ranks[0].verdict


def test_a_verdict_reaches_a_rank_through_its_listener_at_once(store):
    """A rank's listener blocks on ``ended``: the line posted there ends the rank without a beat of its own (a
    rank that watches nothing would read ``verdict`` only at its next POLL-th beat); so does a listener that
    connects after the line was posted."""
    job = Job(store, 4, local=2)
    job.stores[0].set(LIVE_KEY, "2")  # posted with the verdict (_verdict): here the two ranks that acknowledge it
    job.ranks[1]._listener.start()
    job.stores[0].set("ended", "error: a verdict")
    job.ranks[3]._listener.start()
    for r in (1, 3):
        job.ranks[r]._listener.join(timeout=30)
        assert job.codes[r] == [1] and job.ranks[r].verdict == "error: a verdict" and job.ranks[r]._beats == 0


class Flaky:
    """A rank's store client whose call of ``method`` on a key that starts with ``key`` fails once, as a
    connection reset does: the first such call after ``after`` of them."""

    def __init__(self, store, method: str, key: str, after: int = 0):
        self.store, self.method, self.key, self.calls, self.after = store, method, key, 0, after

    @property
    def failed(self) -> bool:
        return self.calls > self.after

    def __getattr__(self, name):
        real = getattr(self.store, name)

        def call(*args):
            first = args[0][0] if isinstance(args[0], list) else args[0]
            if first.startswith(self.key):
                self.calls += 1
                if self.calls == self.after + 1:
                    raise ConnectionResetError("the store's connection was reset")
            return real(*args)

        return call if name == self.method else real


def test_a_store_call_that_fails_while_a_beat_judges_leaves_the_beat_thread_going(store):
    """A beat's judgement makes store calls of its own (the host names, the check of counters that never
    appeared, the verdict's post and its announcement); ``judge`` runs outside the beat loop's ``except``, so one
    of them failing must not end the beat thread (a traceback, then a live rank that never beats again, or a
    verdict lost): the names are read next beat, the absent peer named next beat, the verdict still ends the rank."""
    job = Job(store, 2)
    job.stores[0] = Flaky(job.stores[0], "check", "host/")
    job.beat(0)
    job.beat(1)
    assert job.ranks[0]._hosts_loaded and job.ended() == []

    job = Job(store, 2, step=0)
    job.stores[1].delete_key("hb/1")  # rank 1 never beat
    job.stores[0] = Flaky(job.stores[0], "check", "hb/1", after=2)  # exchange's checks pass, _absent's fails
    for t in [0, 10.1]:
        job.beat(t, ranks=[0])
    assert job.ended() == [] and job.stores[0].failed
    job.beat(11.1, ranks=[0])
    assert job.ended() == [0] and re.match(r"error: rank 1 on host \S+ \(127\.0\.0\.1\) silent", job.ranks[0].verdict)

    for method, key in [("compare_set", LIVE_KEY), ("set", "ended")]:  # the verdict's post, its announcement
        job = Job(store, 2)
        job.beat(0)
        job.stores[0] = Flaky(job.stores[0], method, key)
        job.beat(10.1, ranks=[0])
        assert job.ended() == [0] and job.stores[0].failed and "rank 1 on host" in job.ranks[0].verdict, method


def test_the_store_line_and_a_non_watcher_allows_its_polls(store):
    """A rank that watches nothing hears the store every POLL beats: it allows those more before naming the
    store (a watcher names it first); the line names the store's host and the step, no duration."""
    job = Job(store, 4, local=2)
    job.beat(0)
    assert job.ranks[0]._store_limit() == TIMEOUT and job.ranks[1]._store_limit() == TIMEOUT + (POLL - 1) * BEAT
    job.ranks[1]._end(job.ranks[1]._store_line())  # as its guard thread does when the store stops answering
    line = job.ranks[1].verdict
    assert job.codes[1] == [1] and not job.stores[0].check([ACKS_KEY])  # no store to acknowledge through: not tried
    assert re.match(
        r"error: the job's store at 127\.0\.0\.1:\d+ \(host \S+ \(127\.0\.0\.1\)\) has stopped answering \(dead, "
        r"frozen or cut off\) at step 5; ending the job$",
        line,
    ), line


def test_the_guard_names_a_store_silent_for_the_timeout_and_a_beat_and_not_sooner(monkeypatch):
    """The guard (the thread that never calls the store) sees a beat thread stuck in a store call: it names the
    store once the last answer is older than the store's silence (the timeout, for a watcher) and the beat that
    answer may lag, and not before: a store that pauses for less (a busy host) ends nothing. Counted on a clock
    that the test sets and the guard reads at each of its looks."""
    clock, looks = [1000.0], []

    def monotonic() -> float:
        looks.append(clock[0])
        return clock[0]

    monkeypatch.setattr(heartbeat, "time", SimpleNamespace(monotonic=monotonic, sleep=time.sleep))
    codes: list[int] = []
    beat = Heartbeat(0, 2, TIMEOUT, exit_fn=codes.append)  # rank 0 watches rank 1: its store's silence is TIMEOUT
    assert beat.watched == [1] and beat._store_limit() == TIMEOUT
    clock[0] += TIMEOUT + 0.5 * BEAT  # the last answer came at 1000.0
    beat._guard_thread.start()
    deadline = time.monotonic() + 30
    while len(looks) < 4 and not codes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(looks) >= 4 and codes == []  # looked thrice at least, silent for less than TIMEOUT + a beat
    clock[0] += BEAT
    beat._guard_thread.join(timeout=30)  # it ends with the line: _finish stops it (exit_fn returned)
    assert codes == [1] and "has stopped answering (dead, frozen or cut off) at step 0" in beat.verdict


def test_a_beat_costs_a_watcher_two_requests_and_any_other_rank_one_and_a_poll(store):
    """Mid-run (the host names read once, at the first beat), a beat is one set of the rank's counter and, for a
    watcher, one read of its slice's counters, ``verdict`` and ``alarm``; a rank that watches nothing reads
    ``verdict`` every POLL-th beat only (issue 43: the store's work per round stays O(1) per rank). Counted with
    launch/bench/scale_store.py's counting client, as tests/cluster/test_scale.py does at 1,024 ranks. A heartbeat
    shorter than 2 s still beats at most 5 times a second."""
    assert Heartbeat(0, 2, 0.5)._period() == 0.2 and Heartbeat(0, 2, 30.0)._period() == 30.0 / BEATS
    job = Job(store, 4, local=2)
    job.beat(0)
    job.stores = [Counting(s) for s in job.stores]
    for t in range(1, 2 * POLL + 1):
        job.beat(t)
    assert job.ended() == []
    assert [s.requests for s in job.stores] == [4 * POLL, 2 * POLL + 2] * 2
    assert [s.keys for s in job.stores] == [2 * POLL * (1 + 2 + 2), 2 * POLL + 2] * 2


def test_the_store_line_names_rank_0s_host_to_a_watcher_of_other_hosts(store):
    """One rank per host: the store's host (MASTER_ADDR's, rank 0's here) is named in the store line also by a
    rank that watches other hosts: it reads rank 0's host name with its slice's, once."""
    job = Job(store, 4)
    for r in range(4):  # distinct hosts, only rank 0's at the store's address
        job.stores[0].set(f"host/{r}", f"h{r} ({'127.0.0.1' if r == 0 else f'198.18.0.{r}'})")
    job.beat(0)
    assert job.ranks[2].watched == [3]
    job.ranks[2]._end(job.ranks[2]._store_line())
    assert "(host h0 (127.0.0.1)) has stopped answering" in job.ranks[2].verdict, job.ranks[2].verdict


def test_a_store_at_an_ipv6_address_still_names_a_silent_peer_by_its_host_name(monkeypatch):
    """MASTER_ADDR an IPv6 address (torchrun and torch's store take one): the probe that finds the address routing
    to the store is IPv4 and cannot connect to it, so a host is called by its name alone; the heartbeat still
    enters, beats and names a silent peer (a probe error that escaped would keep every rank from ever beating,
    and the job would end blaming the store)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    monkeypatch.setenv("MASTER_ADDR", "::1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    servers = []

    def serve():
        servers.append(dist.TCPStore("::1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)))
        monkeypatch.setenv("MASTER_PORT", str(servers[-1].port))

    job = Job(serve, 2)
    job.beat(0)
    job.beat(10.1, ranks=[0])
    assert job.ended() == [0]
    name = re.escape(socket.gethostname())
    assert re.match(rf"error: rank 1 on host {name} silent .* by rank 0 on host {name};", job.ranks[0].verdict)


def test_master_port_must_be_a_tcp_port(monkeypatch):
    for good in ["1", "65535"]:
        monkeypatch.setenv("MASTER_PORT", good)
        assert store_address()[1] == int(good)
    for bad in ["0", "65536", "abc"]:
        monkeypatch.setenv("MASTER_PORT", bad)
        with pytest.raises(ConfigError, match=f"MASTER_PORT='{bad}' is not a TCP port; give a number in 1-65535"):
            store_address()


def test_slices_and_rounds(monkeypatch):
    """A host's ranks up to MAX_SLICE are a slice, larger hosts are cut into slices of 8; one rank watches
    nothing; a torchrun restart sharing the agent's store keys on the agent's restart count."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert slice_size(256, 64) == 64 and slice_size(256, 65) == 8 and slice_size(256, 0) == 8
    assert slice_size(256) == 8 and slice_size(5, 4) == 3 and slice_size(1, 1) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert slice_size(256) == 8
    assert watched(0, 1, 1) == [] and watched(1, 4, 2) == [] and watched(2, 5, 2) == [4] and watched(4, 5, 2) == [0, 1]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert launch_round() == "0"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert launch_round() == "2"
    assert describe_ranks([3, 1, 2], {1: "a", 2: "b", 3: "a"}) == "ranks 1, 3 on host a; rank 2 on host b"
    assert describe_ranks([4], {}) == "rank 4 on host an unknown host"


def _acknowledge_all(serve, live: int, coming: int, interval: float = BEAT, op_s: float = 10.0) -> list[bool]:
    """``coming`` ranks end on a verdict that left ``live`` ranks alive (engine/cluster/verdict.py), each on a
    thread of its own as on its own host: what each one's acknowledge returned."""
    serve()
    connect(1.0).set(LIVE_KEY, str(live))
    done: list[bool] = []
    run_threads([lambda: done.append(acknowledge(lambda: connect(op_s), op_s, interval))] * coming)
    return done


def test_a_verdict_waits_for_every_live_rank_and_not_for_more(store):
    """Every live rank counted in: each one's wait ends with all of them (True); one live rank that never comes
    (it died meanwhile): the others give up within their bound, 2 beats and a store timeout (False), instead of
    waiting for ever; at 0.05 s beats that is 1.1 s (an upper bound 18 times that: load only adds to it)."""
    assert _acknowledge_all(store, 3, 3) == [True] * 3
    assert _acknowledge_all(store, 1, 1) == [True]
    start = time.monotonic()
    assert _acknowledge_all(store, 3, 2, interval=0.05, op_s=1.0) == [False] * 2
    assert 1.0 <= time.monotonic() - start < 20.0  # not less: the live rank's 2 beats to read the verdict


def test_a_rank_that_finished_exits_and_tells_its_peers(store):
    """A rank's process that finished (stop: ``done``, which its watcher reads as never silent) exits normally:
    none of the heartbeat's threads (the listener blocks on ``ended`` for as long as the job lasts) holds the
    interpreter open at exit. Also when the store's host froze (it accepts connections and never answers: every
    store call hangs): stop() gives up telling ``done`` after 2 beats and a store call's timeout (timeout / 3;
    1.6 s here) and the threads stuck in a store call do not keep the finished process alive."""
    store()
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)  # never accepted: a client's connect goes through, then waits for a reply for ever
        code = (
            "import os, sys, time\n"
            "from engine.cluster.heartbeat import Heartbeat\n"
            "beat = Heartbeat(0, 2, 30.0).start()\n"
            "while beat._beats < 1: time.sleep(0.01)\n"  # a busy loop would hold the GIL from its connect
            "beat.stop()\n"
            "print('finished')\n"
            "os.environ['MASTER_PORT'] = sys.argv[1]\n"
            "beat = Heartbeat(0, 2, 3.0).start()\n"
            "start = time.monotonic()\n"
            "beat.stop()\n"
            "print(f'stopped in {time.monotonic() - start:.1f} s')\n"
        )
        port = str(frozen.getsockname()[1])
        done = subprocess.run([sys.executable, "-c", code, port], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("finished\nstopped in "), done.stderr[-2000:]
    assert float(done.stdout.split()[-2]) < 5.0, done.stdout
    assert connect(5.0).get("hb/0") == b"done"


def test_a_rank_whose_store_is_gone_finishes_without_a_traceback(store, monkeypatch):
    """The store's host has left (rank 0, which serves it, finished first): a rank that finishes then, or whose
    heartbeat starts then, prints no traceback from the heartbeat's threads (each store call fails: its beat
    thread tries again next beat, its listener and its last ``done`` give up), only what torch's client logs."""
    store()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))  # closed: refused
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append((args.thread.name, args.exc_value)))
    before = set(threading.enumerate())
    beat = Heartbeat(0, 2, 0.6, exit_fn=lambda code: None).start()
    beat.stop()
    for t in set(threading.enumerate()) - before:
        t.join(timeout=30)  # each of them ends with its failed connect (~1 s)
    assert raised == []


def test_a_store_call_that_fails_is_tried_again_at_the_next_beat(store, monkeypatch):
    """One store call fails (here the beat thread's first connect, refused): the beat thread stays and tries again
    at its next beat; the store is named only when it has not answered for the timeout, and this rank never."""
    store()
    refused, real = [], heartbeat.connect

    def connect_once_refused(timeout_s):
        if threading.current_thread().name == "engine-heartbeat" and not refused:
            refused.append(time.monotonic())
            raise ConnectionRefusedError("the store's host refused the connection")
        return real(timeout_s)

    monkeypatch.setattr(heartbeat, "connect", connect_once_refused)
    codes: list[int] = []
    beat = Heartbeat(0, 2, TIMEOUT, exit_fn=codes.append).start()
    deadline = time.monotonic() + 30
    while beat._beats < 3 and not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop()
    connect(5.0).set("ended", "")  # the listener's wait ends: no thread of the test stays blocked in the store
    beat._listener.join(timeout=10)
    assert refused and beat._beats >= 3 and codes == [] and beat.verdict is None


def test_the_store_host_is_the_one_with_master_addr(monkeypatch):
    hosts = {0: "h1 (198.18.0.1)", 1: "h2 (198.18.0.2)"}
    monkeypatch.setenv("MASTER_ADDR", "198.18.0.2")
    assert store_host(hosts) == "h2 (198.18.0.2)"
    monkeypatch.setenv("MASTER_ADDR", "198.18.0.9")  # an agent's host that runs no rank: rank 0's is named
    assert store_host(hosts) == "h1 (198.18.0.1)"
    assert store_host({}) == "that of rank 0"
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # a name: resolved
    assert store_host({0: "h1 (198.18.0.1)", 1: "h2 (127.0.0.1)"}) == "h2 (127.0.0.1)"
