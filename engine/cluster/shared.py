"""Start-up: checkpoint.dir and train.out_dir are the same directory on every host.

Every rank writes its part of a checkpoint into checkpoint.dir and rank 0 publishes it (renames step_N, writes
``latest``) once every rank reports its part written. If a host's path is a disk of its own, rank 0 publishes a
step that lacks that host's shards: saved "successfully", unusable. So before the first step every rank writes a
token named by its host and rank into each directory, and (after a collective) looks for every other rank's;
a rank whose token rank 0 cannot see, or that cannot see rank 0's, is on a host that does not share the
directory. Tokens are removed again. A file system that shows a new file late (NFS attribute caching) gets
``SETTLE_S`` seconds before a missing token counts.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SETTLE_S = 10.0
_PREFIX = ".shared-"


def _token_name(host: str, rank: int, token: str) -> str:
    return f"{_PREFIX}{host}-rank{rank}-{token}"


def _write(directory: Path, name: str) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("token\n")
        return True
    except OSError:
        return False


def _seen(directory: Path, names: list[str]) -> list[int]:
    """The ranks whose token is in ``directory``, looked up by name, waiting SETTLE_S for late ones."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        seen = [r for r, name in enumerate(names) if (directory / name).exists()]
        if len(seen) == len(names) or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def _unshared(views: list[tuple[str, list[int]]]) -> list[str]:
    """Hosts (in rank order) whose ranks do not see rank 0's token or whose token rank 0 does not see; when the
    views disagree otherwise, every host with an incomplete view."""
    world, first = len(views), set(views[0][1])
    bad = [views[r][0] for r in range(world) if r not in first or 0 not in views[r][1]]
    if not bad:
        bad = [host for host, seen in views if len(seen) != world]
    return list(dict.fromkeys(bad))


def run_directories(out: Path, root: Path | None) -> list[tuple[Path, str]]:
    """(path, config key) of the directories every host must share: train.out_dir (``out``), and checkpoint.dir
    (``root``) unless none is saved or it is out_dir itself."""
    return [(out, "train.out_dir")] + ([(root, "checkpoint.dir")] if root and root.resolve() != out.resolve() else [])


def check_shared(directories: list[tuple[Path, str]], token: str, rank: int, gather) -> tuple[list[str], str | None]:
    """Every rank: ``directories`` are (path, config key); ``gather(obj)`` all-gathers over the world. Returns the
    host of each rank and the refusal line (None when every directory is shared)."""
    host = socket.gethostname()
    hosts = gather(host)
    names = [_token_name(h, r, token) for r, h in enumerate(hosts)]
    written = [(d, _write(d, names[rank])) for d, _ in directories]
    gather(None)  # every token written before anyone looks
    views = gather([_seen(d, names) if ok else [] for d, ok in written])
    for d, ok in written:
        if ok:
            (d / names[rank]).unlink(missing_ok=True)
    for i, (directory, setting) in enumerate(directories):
        bad = _unshared([(hosts[r], views[r][i]) for r in range(len(hosts))])
        if bad:
            return hosts, _refusal(setting, directory, bad, hosts[0])
    return hosts, None


def _refusal(setting: str, directory: Path, bad: list[str], first: str) -> str:
    return (
        f"{setting} '{directory}' is not shared by host(s) {', '.join(bad)}: rank 0 (on {first}) and their "
        f"ranks do not see each other's files there, so a checkpoint would lack their shards; give a directory "
        f"on a file system every host mounts"
    )


def check_shared_over_ssh(
    ssh: list[str], names: list[str], directories: list[tuple[Path, str]], timeout_s: float
) -> str | None:
    """Preflight's version: the first host writes a token into each directory over ssh, every other host looks
    for it (SETTLE_S for a late one), the first removes it. The refusal line, or None."""

    def run(host: str, command: str) -> bool:
        try:
            return subprocess.run([*ssh, host, command], capture_output=True, timeout=timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    for directory, setting in directories:
        path = shlex.quote(str(directory / f"{_PREFIX}preflight-{uuid.uuid4().hex[:8]}"))
        if not run(names[0], f"mkdir -p {shlex.quote(str(directory))} && touch {path}"):
            return f"{setting} '{directory}' cannot be written on {names[0]}"
        look = f"for i in $(seq {int(SETTLE_S * 2)}); do test -e {path} && exit 0; sleep 0.5; done; exit 1"
        try:
            with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
                seen = list(pool.map(lambda host: run(host, look), names[1:]))
        finally:
            run(names[0], f"rm -f {path}")
        bad = [host for host, ok in zip(names[1:], seen) if not ok]
        if bad:
            return _refusal(setting, directory, bad, names[0])
    return None


def describe_hosts(hosts: list[str]) -> str | None:
    """'hosts: h1 ranks 0-1, h2 ranks 2-3' for a world on more than one host (ranks listed as runs)."""
    ranks: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        ranks.setdefault(h, []).append(r)
    if len(ranks) < 2:
        return None

    def runs(rs: list[int]) -> str:
        out, start = [], rs[0]
        for a, b in zip(rs, rs[1:] + [None]):
            if b != a + 1:
                out.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        return ",".join(out)

    return "hosts: " + ", ".join(f"{h} ranks {runs(rs)}" for h, rs in ranks.items())
