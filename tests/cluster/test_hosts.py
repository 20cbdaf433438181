"""Multi-node across real hosts: network namespaces with their own names, addresses and sshd (tests/hosts.py),
a shared file system, and both launchers (the deepspeed launcher through pdsh and ssh; one torchrun agent per
host meeting at the first host's address). tests/cluster/test_multinode.py keeps the one-host (loopback) cases.

Each job prints which host ran which ranks (engine/cluster/shared.py, rank 0); the tests assert every host ran
its own. Losses and gradient norms are compared with one process within the parity suite's fp32 bounds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests import hosts
from tests.cli import ROOT
from tests.cluster.hostjobs import (
    LIMIT_S,
    assert_follows,
    deepspeed_on_hosts,
    one_process,
    records,
    torchrun_on_hosts,
    train_args,
)
from tests.parity.runner import FP32


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """One process, the same model and steps."""
    return one_process(tmp_path_factory.mktemp("one_process"))


def test_hosts_have_their_own_names_addresses_and_sshd(make_hosts):
    """The fixture itself: each host has its name, its 198.18 address, no default route, reaches the others over
    ssh by name; a namespace left by a dead run is removed by the next set-up, and teardown leaves nothing."""
    stale = f"{hosts.PREFIX}999999999z-h1"  # no such pid: a crashed run's
    hosts._run("ip", "netns", "add", stale)
    cluster = make_hosts(3)
    assert stale not in hosts._run("ip", "netns", "list").stdout
    for i, host in enumerate(cluster.hosts, 1):
        seen = cluster.ssh(cluster.hosts[0], host, "hostname; hostname -I; ip route")
        assert seen.returncode == 0, seen.stderr
        name, addr, routes = seen.stdout.split("\n", 2)
        assert (name, addr.strip()) == (f"h{i}", f"198.18.0.{i}")
        assert "default" not in routes and routes.startswith("198.18.0.0/24"), routes
    cluster.down()
    listed = hosts._run("ip", "netns", "list").stdout + hosts._run("ip", "link").stdout
    assert cluster.id not in listed and not cluster.folder.exists()
    assert all(
        not os.path.exists(f"/proc/{h.pid}") or open(f"/proc/{h.pid}/stat").read().split()[2] == "Z"
        for h in cluster.hosts
    )


def test_clean_up_keeps_a_live_clusters_links(make_hosts):
    """Another live process's cluster is never touched: its veths are named ``eng-t-<pid><letter><index>``, and
    reading every digit of that name as the pid (the bug of round five) took a live cluster's veth for a dead one's.
    A link named as a live process's veth survives ``clean_leftovers``; once that process is gone, it goes."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    link = f"{hosts.PREFIX}{live.pid}a1"
    try:
        hosts._run("ip", "link", "add", link, "type", "bridge")
        hosts.clean_leftovers()
        assert link in hosts._run("ip", "-o", "link", "show").stdout, "a live cluster's veth was removed"
    finally:
        live.kill()
        live.wait()
    hosts.clean_leftovers()
    assert link not in hosts._run("ip", "-o", "link", "show").stdout, "a dead run's veth was left"


def test_deepspeed_launcher_tp2_pp2_across_two_hosts(make_hosts, tmp_path, reference):
    """The deepspeed launcher on h1 (pdsh over ssh starts h2's share), 2 slots per host, tp 2 x pp 2: each host runs
    its two ranks; losses and gradient norms are one process's. h2's name resolves to 127.0.1.1 on h2 (Debian's
    /etc/hosts line), fixed as the README says: GLOO_SOCKET_IFNAME in .deepspeed_env (the refusal without it:
    test_loopback_host_name_is_refused_with_the_fix)."""
    cluster, out = make_hosts(2, loopback=("h2",)), tmp_path / "run"
    args = train_args(out, "--parallel.tp", "2", "--parallel.pp", "2")
    run = deepspeed_on_hosts(cluster, 2, args, tmp_path, ["GLOO_SOCKET_IFNAME=eth0"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "h1: hosts: h1 ranks 0-1, h2 ranks 2-3" in run.stdout, run.stdout[-3000:]  # pdsh prefixes the host
    assert "layout tp=2 pp=2 dp=1 on 4 x" in run.stdout, run.stdout[-3000:]
    assert_follows(out, reference)


def test_torchrun_dp2_zero2_across_two_hosts(make_hosts, tmp_path, reference):
    """torchrun multi-node: one agent per host, one rank each, dp 2 with DeepSpeed ZeRO-2 (its gradient
    reduce-scatter and parameter all-gather cross the hosts)."""
    cluster, out = make_hosts(2), tmp_path / "run"
    codes, output = torchrun_on_hosts(
        cluster, 1, train_args(out, "--parallel.dp_mode", "zero", "--parallel.zero_stage", "2"), tmp_path
    )
    assert codes == [0, 0], output[-3000:]
    assert "hosts: h1 ranks 0, h2 ranks 1" in output and "layout tp=1 pp=1 dp=2 on 2 x" in output, output[-3000:]
    assert_follows(out, reference)


@pytest.mark.slow  # ~100 s of launches; CI has tp2 x pp2 under the deepspeed launcher
def test_torchrun_tp2_pp2_across_two_hosts(make_hosts, tmp_path, reference):
    """torchrun multi-node: one agent per host (2 x 2 processes), tp 2 x pp 2; each host runs its two ranks."""
    cluster, out = make_hosts(2), tmp_path / "run"
    codes, output = torchrun_on_hosts(cluster, 2, train_args(out, "--parallel.tp", "2", "--parallel.pp", "2"), tmp_path)
    assert codes == [0, 0], output[-3000:]
    assert "hosts: h1 ranks 0-1, h2 ranks 2-3" in output and "layout tp=2 pp=2 dp=1 on 4 x" in output, output[-3000:]
    assert_follows(out, reference)


@pytest.mark.slow  # ~1 min of launches; CI has dp 2 x ZeRO-2 across the hosts
def test_torchrun_ep2_across_two_hosts(make_hosts, tmp_path):
    """Expert parallelism's token all-to-all across hosts: the MoE config, ep 2 over dp 2, one rank per host;
    losses, gradient norms and the load-balancing loss are one process's."""
    moe = "configs/tiny-moe.yaml"
    want = one_process(tmp_path / "one_process", config=moe)
    cluster, out = make_hosts(2), tmp_path / "run"
    codes, output = torchrun_on_hosts(cluster, 1, train_args(out, "--parallel.ep", "2", config=moe), tmp_path)
    assert codes == [0, 0], output[-3000:]
    assert "hosts: h1 ranks 0, h2 ranks 1" in output and "layout tp=1 pp=1 dp=2 ep=2 on 2 x" in output, output[-3000:]
    assert_follows(out, want)
    got = records(out)
    assert [r["moe_aux_loss"] for r in got] == pytest.approx([r["moe_aux_loss"] for r in want], rel=FP32.loss)


def test_torchrun_cp2_across_two_hosts(make_hosts, tmp_path, reference):
    """Context parallelism's ring across hosts: cp 2, one rank per host (the K/V blocks' p2p ring crosses the
    hosts every step). ~8 s: the layout issue 35 asks CI to run beside tp 2 x pp 2 and dp 2 x ZeRO-2."""
    cluster, out = make_hosts(2), tmp_path / "run"
    codes, output = torchrun_on_hosts(
        cluster, 1, train_args(out, "--parallel.cp", "2", "--parallel.cp_mode", "ring"), tmp_path
    )
    assert codes == [0, 0], output[-3000:]
    assert "hosts: h1 ranks 0, h2 ranks 1" in output and "cp=2" in output, output[-3000:]
    assert_follows(out, reference)


def test_loopback_host_name_is_refused_with_the_fix(make_hosts, tmp_path):
    """h2's name resolves to 127.0.1.1 on h2 (Debian's /etc/hosts line): gloo would tell h1 to connect to
    127.0.1.1. Every host refuses at start-up with one line naming h2 and the fix (exit 2), instead of "Connection
    refused" from inside init_process_group. With the fix the deepspeed launcher trains tp 2 x pp 2 across the
    same two hosts: test_deepspeed_launcher_tp2_pp2_across_two_hosts."""
    cluster = make_hosts(2, loopback=("h2",))
    codes, output = torchrun_on_hosts(cluster, 1, train_args(tmp_path / "refused"), tmp_path)
    line = (
        "error: host h2: its host name resolves to 127.0.1.1, a loopback address, so the other hosts would "
        "connect to themselves (gloo: Connection refused); set GLOO_SOCKET_IFNAME=eth0"
    )
    assert codes == [1, 1] and output.count(line) == 2, output[-3000:]  # once per host
    assert len(re.findall(r"exitcode\s+: 2 ", output)) == 2, output[-3000:]


def test_checkpoint_dir_not_shared_is_refused(make_hosts, tmp_path):
    """h2 sees a disk of its own at checkpoint.dir (a tmpfs mounted in h2's mount namespace only): rank 0 would
    publish checkpoints without h2's shards. Refused at start-up on both hosts, exit 2, one line naming h2, and
    nothing in either view of the directory that a resume would take for a checkpoint."""
    cluster, ckpt = make_hosts(2), tmp_path / "ckpt"
    ckpt.mkdir()
    mounted = cluster.hosts[1].run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(ckpt)])
    assert mounted.returncode == 0, mounted.stderr
    args = train_args(tmp_path / "run", "--checkpoint.dir", str(ckpt), "--checkpoint.every", "1")
    codes, output = torchrun_on_hosts(cluster, 1, args, tmp_path)
    line = f"error: checkpoint.dir '{ckpt}' is not shared by host(s) h2: rank 0 (on h1)"
    assert codes == [1, 1] and output.count(line) == 2, output[-3000:]
    assert len(re.findall(r"exitcode\s+: 2 ", output)) == 2, output[-3000:]
    for host in cluster.hosts:
        listing = host.run(["ls", "-A", str(ckpt)]).stdout.split()
        assert not [n for n in listing if n.startswith("step_") or n == "latest" or n.startswith(".shared-")], (
            host.name,
            listing,
        )


def test_a_host_with_another_config_or_engine_checkout_is_refused(make_hosts, tmp_path):
    """h2 launched with another --train.lr, then from a copy of the checkout with one engine file edited: without
    the start-up comparison both trained (a drifted replica). Every host refuses before the first step with the
    same line naming h2 and the first differing key or file, exit 2, nothing written (engine/cluster/drift.py).
    tp 2 on one slot per host puts the tp group across the hosts: each host warns at start-up, naming the fix."""
    cluster, out, ckpt = make_hosts(2), tmp_path / "run", tmp_path / "ckpt"
    args = train_args(out, "--checkpoint.dir", str(ckpt), "--checkpoint.every", "1", "--parallel.tp", "2")
    copy = tmp_path / "checkout"
    for part in ("engine", "launch", "configs"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "engine" / "optim.py").open("a") as f:
        f.write("# edited on h2 only\n")
    h1, h2 = "h1 (198.18.0.1)", "h2 (198.18.0.2)"
    cases = [
        ((ROOT, [*args, "--train.lr", "0.001"]), f"runs another config than host {h1}: train.lr 0.001 != 0.003;"),
        ((copy, args), f"runs another engine checkout than host {h1}: engine/optim.py differs (sha256 "),
    ]
    for i, (h2_launch, differs) in enumerate(cases):
        codes, output = torchrun_on_hosts(cluster, 1, args, tmp_path / f"logs{i}", differ={"h2": h2_launch})
        line = f"error: host {h2} {differs}"
        assert codes == [1, 1] and output.count(line) == 2, output[-3000:]  # once per host
        assert len(re.findall(r"exitcode\s+: 2 ", output)) == 2, output[-3000:]
        assert not out.exists() and not ckpt.exists(), "nothing is written before the check"
        warning = "warning: parallel.tp=2 puts tensor-parallel groups across hosts: this host runs 1 rank (rank "
        assert output.count(warning) == 2 and "set parallel.tp to a divisor of 1" in output, output[-3000:]


def test_preflight_names_a_host_name_that_resolves_differently(make_hosts, tmp_path):
    """h2's /etc/hosts maps h1 to a stale address. torchrun with `--rdzv-endpoint h1:PORT` then hangs where no engine
    code runs yet: h2's agent cannot reach the rendezvous and gives up after read_timeout (60 s), h1's agent waits
    for it the whole join_timeout (645 s measured); with the endpoint an address, h2's ranks cannot reach the
    store at MASTER_ADDR h1 and h1's name them missing. Preflight asks every host how it resolves each host name
    and fails h2 in one line naming the name, both addresses and both hosts (README, Multi-node troubleshooting)."""
    cluster = make_hosts(2, resolve={"h2": {"h1": "198.18.0.9"}})
    cmd = [
        sys.executable,
        "launch/preflight.py",
        "--hostfile",
        str(cluster.hostfile(tmp_path / "hostfile", 1)),
        "--skip-links",
        "--timeout-s",
        "120",
    ]
    run = cluster.hosts[0].run(cmd, cwd=ROOT, timeout=LIMIT_S)
    line = "FAIL h2: resolves host name h1 to 198.18.0.9 where h1 resolves it to 198.18.0.1: its ranks and torchrun"
    assert run.returncode == 1 and line in run.stdout, run.stdout + run.stderr
    assert "FAIL h1" not in run.stdout, run.stdout


@pytest.mark.slow  # minutes of launches across the hosts; CI keeps tp2 x pp2 and the unshared directory
def test_preflight_names_the_loopback_host_and_the_unshared_directory(make_hosts, tmp_path):
    """Preflight over ssh from h1: h2's loopback name fails h2's host check; with GLOO_SOCKET_IFNAME in
    .deepspeed_env (which preflight's remote commands get, as the job's ranks would) the host checks pass and
    checkpoint.dir, a disk of h2's own, fails; with it shared, the link test runs across both hosts."""
    cluster, ckpt = make_hosts(2, loopback=("h2",)), tmp_path / "ckpt"
    ckpt.mkdir()
    assert cluster.hosts[1].run(["mount", "-t", "tmpfs", "tmpfs", str(ckpt)]).returncode == 0
    config = tmp_path / "job.yaml"
    config.write_text(f"train:\n  out_dir: {tmp_path / 'run'}\ncheckpoint:\n  dir: {ckpt}\n")
    env_file = tmp_path / "deepspeed_env"

    def preflight(*extra: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "launch/preflight.py",
            "--hostfile",
            str(cluster.hostfile(tmp_path / "hostfile", 1)),
            "--config",
            str(config),
            "--timeout-s",
            "120",
            *extra,
        ]
        return cluster.hosts[0].run(cmd, cwd=ROOT, timeout=LIMIT_S, env={**os.environ, "DS_ENV_FILE": str(env_file)})

    run = preflight("--skip-links")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAIL h2: its host name resolves to 127.0.1.1, a loopback address" in run.stdout, run.stdout
    env_file.write_text("GLOO_SOCKET_IFNAME=eth0\n")
    run = preflight("--skip-links")
    assert run.returncode == 1 and f"error: checkpoint.dir '{ckpt}' is not shared by host(s) h2" in run.stderr, (
        run.stdout + run.stderr
    )
    assert cluster.hosts[1].run(["umount", str(ckpt)]).returncode == 0
    run = preflight()
    assert run.returncode == 0 and "preflight passed" in run.stdout, run.stdout + run.stderr
    assert re.search(r"p2p rank 0 \(h1\) <-> rank 1 \(h2\)", run.stdout), run.stdout
    assert not list(ckpt.iterdir()), "preflight's tokens are removed"
