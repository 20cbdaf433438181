"""Preflight: check a multi-node job's hosts, environments and links before it spends cluster time.

    python launch/preflight.py --hostfile hostfile [--config configs/X.yaml] [--ssh "ssh -p 2222"]
    python launch/preflight.py --local 4 [--config configs/X.yaml]    # collectives only, 4 forked ranks here
    python launch/preflight.py --plan-only --hosts 2048 [--slots 8]    # the plan and its time at that size

1. The hostfile parses (an error names the line) and the config loads and fits the world (the sum of slots).
2. Every host answers over ssh, --fanout (256) at a time, with the same Python, torch, packages and engine
   checkout as this one (engine/cluster/hostcheck.py), and has the config file at the same path with the same
   contents; its host name does not resolve to a loopback address (engine/cluster/netcheck.py); and the
   config's checkpoint.dir and train.out_dir are the same directory on every host (engine/cluster/shared.py).
   Remote commands get .deepspeed_env's variables, as the deepspeed launcher's ranks do.
3. An all-reduce and a p2p test per link (engine/cluster/linktest.py) across the job's whole world with the
   job's backend: one torchrun per host started over ssh, each command printed so it can be run by hand. The
   pairs run in rounds of disjoint pairs: each host's first rank with its local ranks, then 4 rounds in which
   every host is paired with another (O(hosts) pairs in slots + 3 rounds, not every pair of hosts one by one).
Exit status: 0 all good; 1 a host failed, each failing host named; 2 bad input, one `error: ...` line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from engine.cluster.hostcheck import (  # noqa: E402
    DEFAULT_SSH,
    FANOUT,
    HostResult,
    check_hosts,
    deepspeed_env,
    describe,
    remote_command,
    ssh_command,
)
from engine.cluster.hostfile import Host, HostfileError, parse_hostfile  # noqa: E402
from engine.cluster.keepalive import advice as keepalive_advice  # noqa: E402
from engine.config import ConfigError, load  # noqa: E402


class HostFailure(Exception):
    """One or more hosts failed a check; ``str(e)`` names them."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hostfile", help="DeepSpeed hostfile: 'HOST slots=N' per line")
    where.add_argument(
        "--local", type=int, metavar="N", help="only the link test, on N forked gloo ranks of this machine"
    )
    p.add_argument("--config", default="", help="the job's config: checked on every host; gives backend, timeout")
    p.add_argument("--ssh", default=DEFAULT_SSH, help=f"ssh command prefix (default: {DEFAULT_SSH!r})")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on the first host for the link test")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), help="default: the config's parallel.backend")
    p.add_argument("--size-mb", type=float, default=16.0, help="message size of the link test")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per link")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per collective, and per host check")
    p.add_argument("--skip-links", action="store_true", help="stop after the host checks")
    p.add_argument("--fanout", type=int, default=FANOUT, help=f"host checks in flight at once (default {FANOUT})")
    p.add_argument("--plan-only", action="store_true", help="print the plan (waves, rounds, pairs, time) and stop")
    p.add_argument("--hosts", type=int, default=0, help="with --plan-only and no --hostfile: this many hosts")
    p.add_argument("--slots", type=int, default=8, help="with --hosts: ranks per host (default 8)")
    p.add_argument("--check-s", type=float, default=10.0, help="--plan-only: seconds one host check takes")
    p.add_argument("--round-s", type=float, default=0.06, help="--plan-only: seconds one round of pairs takes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of the link test
    p.add_argument("--label", default="", help=argparse.SUPPRESS)  # the hostfile name of the worker's host
    args = p.parse_args(argv)
    if not args.worker and args.hostfile is None and args.local is None and not (args.plan_only and args.hosts):
        raise ConfigError(
            "give --hostfile FILE (check the hosts and links of a job), --local N (links only) "
            "or --plan-only --hosts N (the plan at N hosts)"
        )
    if args.fanout < 1 or args.hosts < 0 or args.slots < 1 or args.check_s <= 0 or args.round_s <= 0:
        raise ConfigError(
            f"--fanout={args.fanout}, --slots={args.slots}, --check-s={args.check_s} and --round-s={args.round_s} "
            f"must be positive and --hosts={args.hosts} >= 0"
        )
    if args.local is not None and args.local < 1 or args.iters < 1 or args.size_mb <= 0 or args.timeout_s <= 0:
        raise ConfigError(
            f"--local={args.local}, --iters={args.iters}, --size-mb={args.size_mb} and "
            f"--timeout-s={args.timeout_s} must all be positive"
        )
    args.ssh_argv = ssh_command(args.ssh)
    if not args.worker:
        deepspeed_env()  # a .deepspeed_env that cannot be read: one line now, not in a host's check thread
    return args


def load_job_config(args: argparse.Namespace, world: int):
    """The config, checked against the world size; fills in --backend from it. None without --config."""
    if not args.config:
        args.backend = args.backend or "auto"
        return None
    from engine.parallel.layout.checks import resolve_layout

    args.config = str(Path(args.config).resolve())  # the same absolute path is checked on every host
    cfg = load(["--config", args.config])
    try:
        resolve_layout(cfg, world)
    except ConfigError as e:
        raise ConfigError(f"config {args.config} does not fit {world} processes: {e}") from None
    args.backend = args.backend or cfg.parallel.backend
    return cfg


def torchrun_command(args: argparse.Namespace, hosts: list[Host], host: Host, run_id: str) -> str:
    """The shell command that starts ``host``'s share of the link test (one torchrun agent per host)."""
    endpoint = f"{hosts[0].name.split('@')[-1]}:{args.port}"  # user@node1 -> node1
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(len(hosts)),
        "--nproc-per-node",
        str(host.slots),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"join_timeout={int(args.timeout_s)}",
        "--max-restarts",
        "0",
        "launch/preflight.py",
        "--worker",
        "--label",
        host.name,
        "--backend",
        args.backend,
        "--size-mb",
        str(args.size_mb),
        "--iters",
        str(args.iters),
        "--timeout-s",
        str(args.timeout_s),
    ]
    return f"cd {shlex.quote(str(ROOT))} && {remote_command(cmd)}"


def failure_cause(err: str) -> str:
    """The line of a failed link test's stderr that says why: a rank's `error:` line (a refusal, such as a loopback
    host name), else the last line that is not torchrun's `=====` / `-----` frame."""
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    refusals = [line for line in lines if line.startswith("error:")]
    framed = [line for line in lines if set(line) - set("=-")]
    return (refusals or framed or ["(no output)"])[-1]


def run_link_test_over_ssh(args: argparse.Namespace, hosts: list[Host]) -> None:
    """Start the link test on every host at once over ssh; print rank 0's table; name every host that failed."""
    ssh, run_id = args.ssh_argv, f"preflight-{uuid.uuid4().hex[:8]}"
    procs = {}
    for host in hosts:
        command = torchrun_command(args, hosts, host, run_id)
        print(f"link test on {host.name}: {command}", flush=True)
        procs[host.name] = subprocess.Popen(
            [*ssh, host.name, command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    failed, limit = [], 2 * args.timeout_s + 60  # rendezvous + collectives + start-up
    deadline = time.monotonic() + limit
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the local ssh and what it started (start_new_session)
            out, err = proc.communicate()
            err += f"\nno result within {limit:.0f} s"
        if out.strip():
            print(out.rstrip(), flush=True)
        if proc.returncode != 0:
            failed.append(f"{name} (link test exited {proc.returncode}: {failure_cause(err)})")
    if failed:
        raise HostFailure("link test failed on " + ", ".join(failed))


def _local_rank(size_bytes: int, iters: int):
    import torch

    from engine.cluster.linktest import measure

    return measure("localhost", size_bytes, iters, torch.device("cpu"))


def run_link_test_locally(args: argparse.Namespace) -> None:
    """--local N: the same measurement on N forked gloo ranks of this machine."""
    from engine.cluster.linktest import format_report
    from engine.parallel.layout.spawn import run_ranks

    try:
        report = run_ranks(_local_rank, args.local, int(args.size_mb * 2**20), args.iters, timeout_s=args.timeout_s)[0]
    except Exception as e:  # a rank's failure arrives as its traceback text
        raise HostFailure(f"link test failed on localhost: {str(e).strip().splitlines()[-1]}") from None
    print(format_report(report), flush=True)


def worker(args: argparse.Namespace) -> int:
    """One rank of the link test under torchrun: rank 0 prints the table."""
    import torch
    import torch.distributed as dist

    from engine.cluster.linktest import format_report, measure
    from engine.cluster.netcheck import init_checked
    from engine.parallel.layout.context import env_rank_info, pick_device_and_backend

    rank, world, local_rank = env_rank_info()
    device, backend = pick_device_and_backend(args.backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_checked(backend, rank, world, datetime.timedelta(seconds=args.timeout_s))  # a loopback name: one line
    try:
        report = measure(args.label, int(args.size_mb * 2**20), args.iters, device)
        if report is not None:
            print(format_report(report), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def check_all_hosts(args: argparse.Namespace, hosts: list[Host]) -> list[HostResult]:
    results = check_hosts(hosts, args.ssh_argv, str(ROOT), args.config, timeout_s=args.timeout_s, fanout=args.fanout)
    for r in results:
        print(describe(r), flush=True)
    bad = [f"{r.host.name} ({'; '.join(r.problems)})" for r in results if r.problems]
    if bad:
        raise HostFailure("host check failed on " + ", ".join(bad))
    return results


def check_shared_directories(args: argparse.Namespace, cfg, hosts: list[Host]) -> None:
    """The config's train.out_dir and checkpoint.dir are one directory on every host (relative ones: below the
    checkout, where the job starts)."""
    from engine.cluster.shared import check_shared_over_ssh, run_directories

    directories = run_directories(
        Path(ROOT, cfg.train.out_dir), Path(ROOT, cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    )
    problem = check_shared_over_ssh(args.ssh_argv, [h.name for h in hosts], directories, args.timeout_s)
    if problem:
        raise HostFailure(problem)
    print("shared directories: " + ", ".join(f"{s} '{d}'" for d, s in directories), flush=True)


def plan(hosts: int, slots: int, fanout: int, check_s: float, round_s: float) -> tuple[list[str], float]:
    """Preflight's plan at ``hosts`` hosts of ``slots`` ranks -> (lines, estimated seconds): the host checks in
    waves of ``fanout`` taking ``check_s`` each, the link test's rounds taking ``round_s`` each (linktest)."""
    from engine.cluster.linktest import plan_lines

    waves = -(-hosts // fanout)
    links, link_s = plan_lines(hosts, slots, round_s)
    total = waves * check_s + link_s
    return [
        f"host checks: {hosts} hosts, {min(fanout, hosts)} at once: {waves} waves x {check_s:.1f} s = "
        f"{waves * check_s:.1f} s",
        *links,
        f"preflight estimate at {hosts} hosts: {total:.1f} s ({total / 60:.1f} min) plus start-up and the all-reduce",
    ], total


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.plan_only:
        hosts = parse_hostfile(args.hostfile) if args.hostfile else []
        count, slots = (len(hosts), max(h.slots for h in hosts)) if hosts else (args.hosts, args.slots)
        print("\n".join(plan(count, slots, args.fanout, args.check_s, args.round_s)[0]), flush=True)
        return 0
    if args.local is not None:
        load_job_config(args, args.local)
        run_link_test_locally(args)
        return 0
    hosts = parse_hostfile(args.hostfile)
    world = sum(h.slots for h in hosts)
    cfg = load_job_config(args, world)
    print(f"hostfile {args.hostfile}: {len(hosts)} hosts, {world} processes", flush=True)
    check_all_hosts(args, hosts)
    if cfg is not None:
        check_shared_directories(args, cfg, hosts)
    if not args.skip_links:
        run_link_test_over_ssh(args, hosts)
    print(keepalive_advice(os.environ), flush=True)
    print("preflight passed", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, HostfileError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except HostFailure as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
