"""Elastic shrink (README "Elastic restart"): two torchrun agents of a ``--nnodes 1:2`` job on loopback, one killed
for good (agent and workers) after a checkpoint; the survivor restarts its workers alone, they resume the
checkpoint at the layout that fits the world left (dp 2 -> 1, more accumulation for the same global batch), and
the losses are an uninterrupted run's. A layout that cannot shrink ends the job with one line and exit 2. A host
that comes back grows the job again (three namespace hosts, ``--nnodes 2:3``): the agents' SIGTERM is a restart to
the workers, not a user's stop, and the job finishes at dp 3."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from engine.checkpoint.contents import layout_change
from engine.checkpoint.format import CheckpointError
from engine.checkpoint.lock import LOCK, CheckpointLock
from tests import hosts
from tests.cli import ROOT
from tests.cluster.jobs import (
    RDZV_CONF,
    Job,
    agent,
    final_losses,
    logged_steps,
    read_losses,
    restart_args,
    train_args,
)
from tests.dist import free_port


def elastic_agent(
    endpoint: str,
    rdzv_id: str,
    args: list[str],
    host_store: bool,
    restarts: int = 3,
    nproc: int = 2,
    conf: str = RDZV_CONF,
    nnodes: str = "1:2",
) -> list[str]:
    """One agent of a 1-to-2-node job (``nnodes``). ``is_host`` pins which agent serves the c10d rendezvous store:
    the job can only restart while the store's host lives (an etcd rendezvous has no such host), so another one
    is the one killed."""
    conf = f"{conf},is_host={'true' if host_store else 'false'}"
    return agent(nnodes, nproc, endpoint, args, restarts, rdzv_id=rdzv_id, conf=conf)


def two_agents(job: Job, args: list[str], restarts: int = 3) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = free_port()
    # A fresh store per round (as tests/cluster/test_multinode.py's restarts: pytorch/pytorch#135712)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    endpoint, rdzv_id = f"127.0.0.1:{port}", f"elastic-{port}"
    keeper = job.start(elastic_agent(endpoint, rdzv_id, args, True, restarts), env)
    return keeper, job.start(elastic_agent(endpoint, rdzv_id, args, False, restarts), env)


def kill_for_good(job: Job, agent: subprocess.Popen) -> None:
    """The agent and its workers at once (a host gone). Not its process group: torchrun starts each worker in a
    session of its own, and a killpg of the agent alone leaves them training on."""
    victims = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    for proc in victims:
        proc.kill()
    psutil.wait_procs(victims, timeout=60)
    job.procs.remove(agent)


def one_process(reference: Path, env: dict | None = None) -> None:
    """The uninterrupted run the survivors must match: one process, tp 1, into ``reference``."""
    run = subprocess.run(
        [sys.executable, *train_args(reference), "--parallel.tp", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def assert_shrunk(text: str, out: Path, reference: Path, before: str, after: str, why: str) -> None:
    """Both layouts printed, the one resume line saying why, and the uninterrupted run's losses."""
    assert f"layout {before}" in text and f"layout {after}" in text, text[-4000:]
    line = [x for x in text.splitlines() if "resume: checkpoint step" in x]
    assert len(line) == 1 and why in line[0], text[-4000:]
    assert final_losses(out) == pytest.approx(read_losses(reference), rel=1e-5)


# The gone host's rendezvous keep-alives lapse after 5 s x 2 and the survivors' new round closes 5 s after its last
# join (the defaults, 10 s x 6 here and 30 s, spent ~70 of the ~100 s this test took): the same path, sooner.
FAST_ROUNDS = ",".join(
    [kv for kv in RDZV_CONF.split(",") if not kv.startswith("keep_alive")]
    + ["keep_alive_interval=5", "keep_alive_max_attempt=2", "last_call_timeout=5"]
)


def host_agent(
    job: Job,
    host: hosts.Host,
    endpoint: str,
    args: list[str],
    store: bool,
    nnodes: str = "1:2",
    gate: Path | None = None,
) -> subprocess.Popen:
    """One agent of a 1-to-2-node job on ``host``, one worker; ``store``: this host serves the rendezvous store.
    ``gate``: the agent imports torch, creates ``gate``.ready and starts only once ``gate`` exists (a process start
    is seconds of imports on a loaded machine; the test times the join, not the imports)."""
    cmd = elastic_agent(endpoint, "elastic", args, store, nproc=1, conf=FAST_ROUNDS, nnodes=nnodes)
    if gate is not None:
        cmd = [cmd[0], "-c", GATED, str(gate), *cmd[3:]]  # cmd[1:3] is "-m torch.distributed.run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # A log per start: a host that comes back gets a new one (job.output() reads them all, in start order)
    with job.next_log().open("w") as log:
        job.procs.append(
            host.popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )
    return job.procs[-1]


# torchrun's main, entered once the gate file exists (imports done before: the .ready file says so)
GATED = """import pathlib, sys, time
from torch.distributed import run
gate = pathlib.Path(sys.argv[1])
pathlib.Path(f"{gate}.ready").touch()
while not gate.exists():
    time.sleep(0.05)
run.main(sys.argv[2:])
"""


def test_survivor_host_continues_at_the_shrunk_layout(make_hosts, tmp_path):
    """Two namespace hosts, dp 2 (one rank each), h1 serving the rendezvous store; after a checkpoint h2 dies for
    good (every process on it, its sshd too). h1's agent restarts its worker alone: it resumes the checkpoint at
    dp 1 with twice the accumulation, says so in one line, and the losses are an uninterrupted run's."""
    out, ckpt, reference = tmp_path / "run", tmp_path / "ckpt", tmp_path / "reference"
    one_process(reference, env={**os.environ, "OMP_NUM_THREADS": "1"})
    cluster, job = make_hosts(2), Job(tmp_path)
    h1, h2 = cluster.hosts
    try:
        args = restart_args(out, ckpt, "--parallel.tp", "1")
        keeper = host_agent(job, h1, f"{h1.addr}:29400", args, True)
        gone = host_agent(job, h2, f"{h1.addr}:29400", args, False)
        job.wait_for(lambda: (ckpt / "latest").exists(), "checkpoint", timeout=400)
        start = time.monotonic()
        hosts._kill_inside(h2.ns)  # the host is gone: its agent, worker and sshd
        job.procs.remove(gone)
        assert job.wait([keeper], timeout=600) == [0], job.output()[-4000:]
        elapsed = time.monotonic() - start
        text = job.output()
    finally:
        job.kill_all()
    assert "hosts: h1 ranks 0, h2 ranks 1" in text, text[-4000:]
    assert_shrunk(
        text,
        out,
        reference,
        "tp=1 pp=1 dp=2 on 2 x",
        "tp=1 pp=1 dp=1 on 1 x",
        "saved at tp1 pp1 dp2 (2 ranks); continuing at tp1 pp1 dp1 on 1 rank: the world shrank from 2 to 1",
    )
    print(f"survivor finished {elapsed:.0f} s after h2 died")


# dp 3, 2 and 3 again take the same global batch (2, 3 and 2 micro-batches of 2). 36 steps: the dp 2 round must
# still be training when the test holds it after its first step (with STEPS' 12, it ran its last 9 steps, ~1 s,
# before the hold under the full suite's load, twice, and the job finished at dp 2 without growing)
GROW_STEPS = 36
GROW = ("--train.global_batch_size", "12", "--train.micro_batch_size", "2", "--train.steps", str(GROW_STEPS))


def worker_of(agent: subprocess.Popen, world: int) -> psutil.Process:
    """The one worker that ``agent`` runs in a round of ``world`` ranks."""
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("WORLD_SIZE") == str(world):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of a {world}-rank round under agent {agent.pid}")


def sigterm_pending(proc: psutil.Process) -> bool:
    """A SIGTERM waits for ``proc`` (stopped, it cannot take it): its agent is stopping it."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    pending = int(status.split("ShdPnd:")[1].split()[0], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def ended(proc: psutil.Process) -> bool:
    """``proc`` has exited: a zombie that its agent (stopped) has not reaped, with no thread left (a main thread
    that exited first shows as a zombie too, and its agent would still see it running)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE and proc.num_threads() == 1
    except psutil.NoSuchProcess:
        return True


def test_host_that_comes_back_grows_the_job_which_finishes(make_hosts, tmp_path):
    """``--nnodes 2:3`` on three namespace hosts, h1 serving the store: after a checkpoint h3 dies (its agent and
    worker), h1 and h2 resume at dp 2; h3 comes back (a new agent). h1's agent sees it waiting and stops its worker
    with SIGTERM; h2's agent is held (SIGSTOP) until its worker has ended, so it sees that end before it sees h3,
    which is the order that ended the job: workers that took the agent's SIGTERM for a user's exited 0 and h2's
    agent took the job as finished. Now every worker saves and exits 1, every agent restarts, the three meet, resume
    at dp 3, finish every step and exit 0, with the losses of an uninterrupted run. The dp 2 workers are held too
    while h3's agent joins, so that the SIGTERM finds them training."""
    out, ckpt, reference = tmp_path / "run", tmp_path / "ckpt", tmp_path / "reference"
    uninterrupted = subprocess.Popen(  # meanwhile (a process start is most of its time)
        [sys.executable, *train_args(reference), "--parallel.tp", "1", *GROW],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    cluster, job = make_hosts(3), Job(tmp_path)
    h1, h2, h3 = cluster.hosts
    args = restart_args(out, ckpt, "--parallel.tp", "1", *GROW)
    try:
        keeper, second, first = [host_agent(job, h, f"{h1.addr}:29400", args, h is h1, "2:3") for h in (h1, h2, h3)]
        gate = tmp_path / "h3-back"  # h3's next agent imports now (not its child: the kill below spares it)
        third = host_agent(job, h3, f"{h1.addr}:29400", args, False, "2:3", gate=gate)
        job.wait_for(lambda: (ckpt / "latest").exists(), "checkpoint", timeout=400)
        kill_for_good(job, first)  # h3 is gone
        job.wait_for(lambda: "shrank from 3 to 2" in job.output(), "the shrunk round", timeout=300)
        job.wait_for(lambda: Path(f"{gate}.ready").exists(), "h3's next agent's imports", timeout=120)
        trained = logged_steps(out)
        job.wait_for(lambda: logged_steps(out) > trained, "a step at dp 2", timeout=120)
        workers = [worker_of(keeper, 2), worker_of(second, 2)]
        held = [*workers, psutil.Process(second.pid)]
        for proc in held:
            proc.suspend()
        # h2's agent must be back within its keep-alive (5 s x 2): past it, h1's agent drops it as dead, opens the
        # next round with h3 and closes it 5 s later without h2 (CI once; the gate keeps h3's imports out of it)
        held_at = time.monotonic()
        gate.touch()  # h3 is back
        job.wait_for(lambda: sigterm_pending(workers[0]), "h1's agent stopping its worker", timeout=25)
        for proc in workers:
            proc.resume()
        job.wait_for(lambda: ended(workers[1]), "h2's worker's end", timeout=60)
        held[2].resume()
        print(f"h2's agent held {time.monotonic() - held_at:.1f} s")
        codes = job.wait([keeper], timeout=300)
        text = job.output()
        assert "the world grew from 2 to 3" in text, f"exit code {codes}\n{job.readable()}"
        codes += job.wait([second, third], timeout=300)
        reference_output = uninterrupted.communicate(timeout=300)[0]
    finally:
        job.kill_all()
        if uninterrupted.poll() is None:
            uninterrupted.kill()
            uninterrupted.wait()
    assert codes == [0, 0, 0], job.readable()
    layouts = re.findall(r"layout tp=1 pp=1 dp=(\d)", text)
    assert layouts[0] == "3" and "2" in layouts and layouts[-1] == "3", layouts
    assert "restart: the torchrun agent stopped its workers (a host joined the job" in text, job.readable()
    assert uninterrupted.returncode == 0, reference_output[-3000:]
    assert final_losses(out, GROW_STEPS) == pytest.approx(read_losses(reference), rel=1e-5)  # every step


@pytest.mark.slow  # 4 ranks on loopback, two rendezvous rounds (2-4 min each); CI has the two-host case above
def test_survivor_resumes_at_the_shrunk_layout(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    reference = tmp_path / "reference"
    one_process(reference)
    job = Job(tmp_path)
    try:
        args = restart_args(out, ckpt)
        keeper, gone = two_agents(job, args)
        job.wait_for(lambda: (ckpt / "latest").exists(), "checkpoint", timeout=400)
        start = time.monotonic()
        kill_for_good(job, gone)
        assert job.wait([keeper], timeout=900) == [0], job.output()[-4000:]
        elapsed = time.monotonic() - start
        text = job.output()
    finally:
        job.kill_all()
    assert_shrunk(
        text,
        out,
        reference,
        "tp=2 pp=1 dp=2 on 4 x",
        "tp=2 pp=1 dp=1 on 2 x",
        "saved at tp2 pp1 dp2 (4 ranks); continuing at tp2 pp1 dp1 on 2 ranks: the world shrank from 4 to 2",
    )
    print(f"survivor finished {elapsed:.0f} s after the kill")


@pytest.mark.slow  # two torchrun rendezvous rounds (2-4 min each on 2 cores); the lock and the line: unit tests
def test_layout_that_cannot_shrink_exits_2_with_one_line(tmp_path):
    """tp 4 across both agents: with one agent (2 ranks) left no tp 4 fits; the survivor's workers say so in one
    line and exit 2. torchrun restarts on any non-zero exit: with --max-restarts 1 (spent on the shrink) it then
    gives up."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    job = Job(tmp_path)
    try:
        args = restart_args(out, ckpt, "--parallel.tp", "4", "--model.num_kv_heads", "4")
        keeper, gone = two_agents(job, args, restarts=1)
        job.wait_for(lambda: (ckpt / "latest").exists(), "checkpoint", timeout=400)
        kill_for_good(job, gone)
        code = job.wait([keeper], timeout=900)[0]
        text = job.output()
    finally:
        job.kill_all()
    assert code != 0, text[-4000:]
    refusals = [x for x in text.splitlines() if "cannot shrink" in x]
    assert refusals == [
        "error: elastic restart 1: the layout cannot shrink to the 2 ranks left: invalid layout: "
        "tp(4) * pp(1) * cp(1) * dp(auto) != world size(2); choose tp, pp and cp whose product "
        "divides 2"
    ], text[-4000:]
    assert re.search(r"exitcode\s+: 2", text), text[-4000:]


def _foreign_lock(root: Path, elastic) -> None:
    root.mkdir()
    (root / LOCK).write_text(
        json.dumps({"host": "gone-host", "pid": 4242, "started": 1.0, "run": "r0", "elastic": elastic}) + "\n"
    )


def test_lock_of_an_earlier_round_of_this_job_on_a_gone_host_is_taken_over(tmp_path, monkeypatch):
    """The host that held rank 0 (and the lock) left: the survivors' rank 0, on another host, takes the lock over
    when it is this torchrun job's (same --rdzv-id) from an earlier restart round; another job's, the same
    round's, or one under torchrun's shared default id "none" stays refused."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _foreign_lock(tmp_path / "a", ["job7", 0])
    message = CheckpointLock(tmp_path / "a", "r1").acquire()
    assert "taking over the lock of pid 4242 on host gone-host (run r0, since " in message
    assert message.endswith("), from restart round 0 of this torchrun job"), message
    for name, elastic in [("b", ["job8", 0]), ("c", ["job7", 1]), ("d", None)]:
        _foreign_lock(tmp_path / name, elastic)
        with pytest.raises(CheckpointError, match="is in use by pid 4242 on host gone-host"):
            CheckpointLock(tmp_path / name, "r1").acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    _foreign_lock(tmp_path / "e", ["none", 0])
    with pytest.raises(CheckpointError, match="is in use"):
        CheckpointLock(tmp_path / "e", "r1").acquire()


def test_layout_change_line_names_both_layouts_and_why():
    """The resume line (engine/checkpoint/contents.py layout_change) for a shrink, a growth, a changed setting at
    the same world, none at the same layout, and an index without world_size."""
    cfg = SimpleNamespace(parallel=SimpleNamespace(dp_mode="ddp", zero_stage=0))

    def ctx(tp, pp, dp, cp=1):
        return SimpleNamespace(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp * cp, size=lambda axis: cp)

    index = {"step": 6, "layout": {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}}
    assert layout_change(index, cfg, ctx(2, 1, 1)) == (
        "resume: checkpoint step 6 was saved at tp2 pp1 dp2 (4 "
        "ranks); continuing at tp2 pp1 dp1 on 2 ranks: the world "
        "shrank from 4 to 2"
    )
    assert layout_change(index, cfg, ctx(2, 1, 2, cp=2)).endswith(
        "at tp2 pp1 dp2 cp2 on 8 ranks: the world grew from 4 to 8"
    )
    assert layout_change(index, cfg, ctx(1, 2, 2)).endswith(
        "parallel.tp, pp, dp or cp differ from the checkpoint's run"
    )
    assert layout_change(index, cfg, ctx(2, 1, 2)) is None
    assert "(4 ranks)" in layout_change({"step": 6, "layout": {"tp": 2, "pp": 1, "dp": 2}}, cfg, ctx(2, 1, 1))
