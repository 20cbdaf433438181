"""Test hosts: an N-host cluster of network namespaces on one machine, for the launchers' multi-node paths.

Each host is a network namespace with its own host name (UTS namespace) and its own /etc/hosts (a mount namespace
with a file of the cluster's folder bind-mounted over it, and /etc/ssh/ssh_config likewise: ``ssh h2`` takes the
cluster's key there, as a cluster's shared home would have it), one veth on a bridge without an address, an address in
198.18.0.0/24 (RFC 2544's benchmarking range: routed nowhere) and no default route, so nothing it sends leaves
the bridge; and its own sshd on port 22 taking a throw-away key. The file system is shared, as a cluster's shared
home is. Host names, not addresses, go into hostfiles: gloo advertises the address its own host name resolves to,
which is what the loopback-name case (Debian's ``127.0.1.1 <hostname>``) needs to reproduce.

A command runs "on" a host through ``nsenter`` into its sshd's namespaces (``Host.command``), or over ssh
(``Cluster.ssh``); the deepspeed launcher goes through pdsh and ssh itself.

Every namespace, bridge and veth is named ``eng-t-<pid><letter>...`` after the process that made it, and the
cluster's folder ``eng-t-<pid><letter>`` too; a set-up first removes those of dead processes (a crashed run),
killing the processes left inside their namespaces by pid. Teardown kills only the processes in its own
namespaces (sshd, and what ran under it), by pid.

By hand (root; needs iproute2, util-linux, openssh-server, openssh-client, pdsh):

    python -m tests.hosts up 2          # builds h1, h2; prints how to reach them; tears down on Ctrl-C / SIGTERM
    python -m tests.hosts exec h2 -- hostname -I
    python -m tests.hosts down          # removes what a killed `up` or a crashed test left behind
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "eng-t-"
SUBNET = "198.18.0"
SSHD = "/usr/sbin/sshd"
TOOLS = {
    "ip": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    SSHD: "openssh-server",
    "pdsh": "pdsh",
}
_PR_SET_PDEATHSIG = 1


def missing_tools() -> list[str]:
    """The apt packages whose programs are missing (empty when everything is there)."""
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None and not Path(tool).exists()})


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done


def _die_with_parent() -> None:
    """sshd gets SIGKILL when the process that built the cluster dies (kept across exec: not set-uid), so a
    crashed test leaves no sshd behind."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Host:
    name: str  # host name inside it, "h1"
    ns: str  # network namespace
    addr: str  # 198.18.0.x
    pid: int = 0  # its sshd: the namespaces commands enter

    def command(self, cmd: list[str], cwd: str | Path | None = None) -> list[str]:
        """``cmd`` run on this host: its network, host name and /etc/hosts (the file system is shared), in ``cwd``
        (this process's by default; entering a mount namespace would otherwise start it in /)."""
        return ["nsenter", "-t", str(self.pid), "-n", "-u", "-m", f"--wdns={cwd or os.getcwd()}", "--", *cmd]

    def run(self, cmd: list[str], cwd: str | Path | None = None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd, cwd), **{"capture_output": True, "text": True, **kw})

    def popen(self, cmd: list[str], cwd: str | Path | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(cmd, cwd), **kw)


@dataclass
class Cluster:
    id: str
    folder: Path
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def key(self) -> Path:
        return self.folder / "id"

    def ssh_options(self) -> list[str]:
        return [
            "-i",
            str(self.key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
        ]

    def ssh(self, src: Host, dst: Host, cmd: str) -> subprocess.CompletedProcess:
        """``cmd`` run on ``dst`` over ssh from ``src`` (by host name, as a hostfile names it)."""
        return src.run(["ssh", *self.ssh_options(), dst.name, cmd])

    def pdsh_env(self, base: dict | None = None) -> dict[str, str]:
        """Environment for the deepspeed launcher: pdsh's ssh module appends these options to every ssh."""
        return {**(os.environ if base is None else base), "PDSH_SSH_ARGS_APPEND": " ".join(self.ssh_options())}

    def hostfile(self, path: Path, slots: int) -> Path:
        path.write_text("".join(f"{h.name} slots={slots}\n" for h in self.hosts))
        return path

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def cable(self, host: Host, up: bool) -> None:
        """Plug ``host``'s cable in or pull it (its veth's bridge end): pulled is a partition, in which no socket is
        closed and nothing fails on its own; plugged in again, the host is reachable as before."""
        _run("ip", "link", "set", f"{PREFIX}{self.id}{self.hosts.index(host) + 1}", "up" if up else "down")

    def save(self) -> None:
        state = {"id": self.id, "hosts": [vars(h) for h in self.hosts], "key": str(self.key)}
        (self.folder / "cluster.json").write_text(json.dumps(state, indent=1) + "\n")

    def down(self) -> None:
        for host in self.hosts:
            _kill_inside(host.ns)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for i, host in enumerate(self.hosts, 1):  # the veth first: a namespace's own links go asynchronously
            _run("ip", "link", "del", f"{PREFIX}{self.id}{i}", check=False)
            _run("ip", "netns", "del", host.ns, check=False)
        _run("ip", "link", "del", f"{PREFIX}{self.id}", check=False)
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (ours by construction: the prefix is this suite's), by pid."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _stale(name: str) -> bool:
    """A prefixed name whose creating process is dead (a crashed run); never this process's own."""
    if not name.startswith(PREFIX):
        return False
    # eng-t-<pid><letter>, then "-h2" (namespace) or the host's index (veth, "eng-t-123a1"): the pid is the leading
    # digits alone; joining every digit of the name made a live cluster's veth look like a dead process's
    digits = re.match(r"\d*", name[len(PREFIX) :]).group()
    if not digits:
        return True
    if int(digits) == os.getpid():
        return False
    try:
        os.kill(int(digits), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def clean_leftovers() -> list[str]:
    """Remove the namespaces, bridges and folders of dead runs; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if _stale(ns):
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if _stale(name):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if _stale(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _sshd_config(folder: Path, host: Host) -> Path:
    path = folder / f"sshd_{host.name}"
    path.write_text(
        "\n".join(
            [
                "Port 22",
                f"ListenAddress {host.addr}",
                f"HostKey {folder / 'host_key'}",
                f"AuthorizedKeysFile {folder / 'authorized_keys'}",
                f"PidFile {folder / f'sshd_{host.name}.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "MaxStartups 100",
                "MaxSessions 100",
                "",
            ]
        )
    )
    return path


def _hosts_file(folder: Path, host: Host, hosts: list[Host], loopback: bool, own: dict[str, str]) -> Path:
    """/etc/hosts of ``host``: every host by its 198.18 address; a ``loopback`` host first names itself at
    127.0.1.1, as Debian's installer writes it (glibc takes the first match); ``own`` maps names to addresses of
    this host's own (a stale or hand-edited line) in place of the cluster's."""
    lines = [
        "127.0.0.1 localhost",
        *([f"127.0.1.1 {host.name}"] if loopback else []),
        *(f"{addr} {name}" for name, addr in own.items()),
        *(f"{h.addr} {h.name}" for h in hosts if h.name not in own),
    ]
    path = folder / f"hosts_{host.name}"
    path.write_text("\n".join(lines) + "\n")
    return path


def _start_host(cluster: Cluster, host: Host, index: int, hosts_file: Path) -> None:
    veth = f"{PREFIX}{cluster.id}{index}"
    _run("ip", "netns", "add", host.ns)
    _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
    _run("ip", "link", "set", veth, "master", f"{PREFIX}{cluster.id}", "up")
    inside = ["ip", "netns", "exec", host.ns]
    _run(*inside, "ip", "addr", "add", f"{host.addr}/24", "dev", "eth0")
    _run(*inside, "ip", "link", "set", "eth0", "up")
    _run(*inside, "ip", "link", "set", "lo", "up")
    config = _sshd_config(cluster.folder, host)
    script = (
        f"hostname {host.name} && mount --bind {hosts_file} /etc/hosts && "
        f"mount --bind {cluster.folder / 'ssh_config'} /etc/ssh/ssh_config && exec {SSHD} -D -e -f {config}"
    )
    log = (cluster.folder / f"sshd_{host.name}.log").open("w")
    proc = subprocess.Popen(
        [*inside, "unshare", "--uts", "--mount", "sh", "-c", script],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    cluster.procs.append(proc)
    host.pid = proc.pid  # ip netns exec, unshare and sh each exec the next: this is sshd's pid


def _wait_ssh(cluster: Cluster, timeout: float = 60) -> None:
    """Every host reaches every host's sshd by name (the first host's view and each host's own)."""
    deadline = time.monotonic() + timeout
    first = cluster.hosts[0]
    for host in cluster.hosts:
        while True:
            done = cluster.ssh(first, host, "hostname")
            if done.returncode == 0 and done.stdout.strip() == host.name:
                break
            dead = [p.args for p in cluster.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join((cluster.folder / f"sshd_{h.name}.log").read_text()[-300:] for h in cluster.hosts)
                raise RuntimeError(f"host {host.name}: ssh {done.stderr.strip()!r}, sshd {logs!r}")
            time.sleep(0.2)


def up(
    n: int, base: Path | None = None, loopback: tuple[str, ...] = (), resolve: dict[str, dict[str, str]] | None = None
) -> Cluster:
    """Build hosts h1..hN (addresses 198.18.0.1..N; the names in ``loopback`` resolve to 127.0.1.1 on their own
    host; ``resolve`` {host: {name: address}} gives a host lines of its own, so a name resolves differently there)
    in a folder under ``base`` (the system temp dir by default). Tear down with ``Cluster.down()``."""
    if os.geteuid() != 0:
        raise RuntimeError("test hosts need root (network namespaces, mounts)")
    clean_leftovers()
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    base = Path(base or tempfile.gettempdir())
    letter = 0
    while (base / f"{PREFIX}{os.getpid()}{chr(97 + letter)}").exists() or Path(
        f"/sys/class/net/{PREFIX}{os.getpid()}{chr(97 + letter)}"
    ).exists():
        letter += 1
    cid = f"{os.getpid()}{chr(97 + letter)}"
    folder = base / f"{PREFIX}{cid}"
    folder.mkdir(parents=True)
    cluster = Cluster(cid, folder)
    try:
        for name in ("id", "host_key"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name))
        shutil.copy(folder / "id.pub", folder / "authorized_keys")
        (folder / "ssh_config").write_text(
            "Host *\n"
            + "".join(f"  {o.split('=')[0]} {o.split('=')[1]}\n" for o in cluster.ssh_options()[3::2])
            + f"  IdentityFile {folder / 'id'}\n"
        )
        _run("ip", "link", "add", f"{PREFIX}{cid}", "type", "bridge")
        _run("ip", "link", "set", f"{PREFIX}{cid}", "up")
        cluster.hosts = [Host(f"h{i}", f"{PREFIX}{cid}-h{i}", f"{SUBNET}.{i}") for i in range(1, n + 1)]
        for i, host in enumerate(cluster.hosts, 1):
            _start_host(
                cluster,
                host,
                i,
                _hosts_file(folder, host, cluster.hosts, host.name in loopback, (resolve or {}).get(host.name, {})),
            )
        _wait_ssh(cluster)
        cluster.save()
    except BaseException:
        cluster.down()
        raise
    return cluster


def unavailable(reason: str):
    """Skip a test that cannot run here, but fail it under CI=true: CI installs everything (.ci/run), so a
    missing piece there is a broken set-up, not a machine without it."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def make_hosts_fixture(tmp_path: Path):
    """Body of the ``make_hosts`` fixture: a function up(n, loopback=(), resolve=None) -> Cluster; every cluster it
    made is torn down after the test."""
    missing = missing_tools()
    if missing:
        unavailable(f"test hosts need apt-get install -y {' '.join(missing)}")
    if os.geteuid() != 0:
        unavailable("test hosts need root (network namespaces, bind mounts)")
    made: list[Cluster] = []

    def make(n: int, loopback: tuple[str, ...] = (), resolve: dict[str, dict[str, str]] | None = None) -> Cluster:
        made.append(up(n, tmp_path, loopback, resolve))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.down()


def _running() -> dict:
    states = [json.loads(p.read_text()) for p in Path(tempfile.gettempdir()).glob(f"{PREFIX}*/cluster.json")]
    if not states:
        raise SystemExit("no cluster is up (python -m tests.hosts up N)")
    return states[-1]


def main(argv: list[str]) -> int:
    if argv[:1] == ["up"] and len(argv) == 2:
        cluster = up(int(argv[1]))
        for host in cluster.hosts:
            print(f"{host.name} {host.addr} (netns {host.ns}, sshd pid {host.pid})")
        print(f"ssh key: {cluster.key}\non a host: python -m tests.hosts exec h1 -- CMD\nCtrl-C tears down")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            cluster.down()
        return 0
    if argv[:1] == ["down"]:
        print("\n".join(clean_leftovers()) or "nothing left over")
        return 0
    if argv[:1] == ["exec"] and len(argv) >= 4 and argv[2] == "--":
        host = next((Host(**h) for h in _running()["hosts"] if h["name"] == argv[1]), None)
        if host is None:
            raise SystemExit(f"no host {argv[1]!r}")
        return subprocess.run(host.command(argv[3:])).returncode
    print(__doc__.split("By hand")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
