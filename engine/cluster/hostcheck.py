"""Preflight host checks: ask every host over ssh, in parallel, what it would run the job with, and compare.

Each host runs engine/cluster/hostreport.py, sent on stdin (``ssh HOST PYTHON - ROOT CONFIG``), with the Python at this
process's path in the same checkout path: the deepspeed launcher (pdsh) and torchrun-over-ssh both assume that.
The ssh command is a parameter so that tests (and sites with their own ssh wrappers) can replace it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine.cluster import hostreport
from engine.cluster.hostfile import Host
from engine.cluster.netcheck import loopback_line
from engine.config import ConfigError

# BatchMode: fail instead of asking for a password; ConnectTimeout: an unreachable host fails in seconds.
DEFAULT_SSH = "ssh -o BatchMode=yes -o ConnectTimeout=5"
FANOUT = 256  # host checks in flight at once: 2,048 hosts in 8 waves (ssh clients and threads on this host)


@dataclass
class HostResult:
    host: Host
    report: dict | None = None
    problems: list[str] = field(default_factory=list)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def deepspeed_env() -> dict[str, str]:
    """What the deepspeed launcher adds to every rank's environment: the KEY=VALUE lines of .deepspeed_env (the
    name DS_ENV_FILE gives) in the home directory, then in the working directory (deepspeed/launcher/runner.py).
    Preflight's remote commands run with them too, so it checks what the job will see."""
    env: dict[str, str] = {}
    for folder in (Path.home(), Path.cwd()):
        path = folder / os.environ.get("DS_ENV_FILE", ".deepspeed_env")
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); write KEY=VALUE lines") from None
            except OSError as e:
                raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None
            env.update(line.strip().split("=", 1) for line in text.splitlines() if "=" in line)
    return env


def ssh_command(text: str) -> list[str]:
    """The --ssh prefix split as a shell would; ConfigError for an empty one or an unclosed quote."""
    try:
        argv = shlex.split(text)
    except ValueError as e:  # "No closing quotation", "No escaped character"
        raise ConfigError(f"--ssh {text!r} is not a command line ({e}); close its quotes") from None
    if not argv:
        raise ConfigError(f"--ssh {text!r} names no command; give an ssh command such as {DEFAULT_SSH!r}")
    return argv


def remote_command(cmd: list[str]) -> str:
    """``cmd`` as a remote shell command, with .deepspeed_env's variables set."""
    env = [f"{k}={v}" for k, v in deepspeed_env().items()]
    return shlex.join(["env", *env, *cmd] if env else cmd)


def query_host(
    ssh: list[str], host: str, root: str, config: str, timeout_s: float, names: tuple[str, ...] = ()
) -> tuple[dict | None, str]:
    """(report, '') from ``host``, or (None, why it could not be had); ``names``: the hosts it resolves."""
    command = remote_command([sys.executable, "-", root, *([config] if config or names else []), *names])
    script = Path(hostreport.__file__).read_text()
    try:
        out = subprocess.run([*ssh, host, command], input=script, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"no answer over ssh within {timeout_s:.0f} s"
    except FileNotFoundError:
        raise ConfigError(f"the ssh command {ssh[0]!r} was not found; give a working one with --ssh") from None
    if out.returncode == 255:  # ssh's own failures (unreachable, refused, no key) exit 255
        return None, f"ssh failed: {_last_line(out.stderr)}"
    if out.returncode == 127:
        return None, f"{sys.executable} not found there; every host needs the same Python at the same path"
    if out.returncode != 0:
        return None, f"the host report exited {out.returncode}: {_last_line(out.stderr)}"
    try:
        return json.loads(_last_line(out.stdout)), ""  # login banners may come first; the report is last
    except json.JSONDecodeError:
        return None, f"unreadable host report: {_last_line(out.stdout)!r}"


def compare(local: dict, remote: dict, slots: int, config: str) -> list[str]:
    """What differs on the remote host from here, or is missing there, one phrase each."""
    problems = []
    if remote["python"] != local["python"]:
        problems.append(f"Python {remote['python']} != {local['python']} here")
    for name in ("torch", "engine"):
        theirs, ours = remote[name], local[name]
        if "error" in theirs:
            problems.append(theirs["error"])
        elif theirs.get("version") != ours.get("version"):
            problems.append(f"{name} {theirs.get('version')} != {ours.get('version')} here")
    engine = remote["engine"]
    if "error" not in engine and engine["digest"] != local["engine"]["digest"]:
        problems.append(
            f"engine source differs from this checkout (digest {engine['digest']} != "
            f"{local['engine']['digest']}); sync the checkout"
        )
    for package, version in remote["packages"].items():
        if version != local["packages"].get(package):
            problems.append(f"{package} {version} != {local['packages'].get(package)} here")
    devices = remote["torch"].get("cuda_devices", 0)
    if devices and slots > devices:
        problems.append(f"slots={slots} but only {devices} CUDA devices")
    if config and remote.get("config") is None:
        problems.append(f"config file {config} does not exist there")
    elif config and remote["config"] != local["config"]:
        problems.append(f"config file {config} differs from the local copy")
    return problems


def check_hosts(
    hosts: list[Host], ssh: list[str], root: str, config: str = "", timeout_s: float = 60.0, fanout: int = FANOUT
) -> list[HostResult]:
    """Query the hosts, ``fanout`` at a time; each result lists its problems (empty: the host is fit to run the job).
    Each query ends within ``timeout_s``, so all end within ceil(hosts / fanout) * timeout_s."""
    local, names = hostreport.report(root, config), tuple(dict.fromkeys(h.name for h in hosts))

    def one(host: Host) -> HostResult:
        report, why = query_host(ssh, host.name, root, config, timeout_s, names)
        if report is None:
            return HostResult(host, None, [why])
        return HostResult(host, report, compare(local, report, host.slots, config))

    with ThreadPoolExecutor(max_workers=max(1, min(fanout, len(hosts)))) as pool:
        results = list(pool.map(one, hosts))
    machines = {r.report["host"] for r in results if r.report}  # hostfile lines may name one machine twice
    for r in results if len(machines) > 1 else []:  # a loopback host name only breaks a multi-host job
        line = r.report and r.report.get("net") and loopback_line(r.report["net"])
        if line:
            r.problems.append(line.split(": ", 1)[1])  # the line names the host; describe() names it already
    _compare_names(results)
    return results


def _compare_names(results: list[HostResult]) -> None:
    """A host that resolves one of the job's host names to other addresses than the first host does: its agent
    or ranks would connect elsewhere (torchrun's rendezvous then waits its join_timeout, 600 s by default)."""
    answered = [r for r in results if r.report and "resolves" in r.report]
    if len(answered) < 2:
        return
    first = answered[0]
    for r in answered[1:]:
        for name, ours in first.report["resolves"].items():
            theirs = r.report["resolves"].get(name, ours)
            if theirs != ours:
                r.problems.append(
                    f"resolves host name {name} to {', '.join(theirs) or 'nothing'} where {first.host.name} "
                    f"resolves it to {', '.join(ours) or 'nothing'}: its ranks and torchrun agent would connect "
                    f"elsewhere; make /etc/hosts or DNS agree on every host"
                )
                break


def describe(r: HostResult) -> str:
    """One line per host for the preflight output."""
    if r.problems:
        return f"FAIL {r.host.name}: " + "; ".join(r.problems)
    rep = r.report
    return (
        f"ok   {r.host.name} ({rep['host']}): python {rep['python']}, torch {rep['torch']['version']}, "
        f"engine {rep['engine']['version']} [{rep['engine']['digest']}], "
        f"{rep['torch']['cuda_devices']} CUDA devices, slots={r.host.slots}"
    )
