"""Start-up: checkpoint.dir and train.out_dir are the same directory on every host.

Every rank writes its part of a checkpoint into checkpoint.dir and rank 0 publishes it (renames step_N, writes
``latest``) once every rank reports its part written. If a host's path is a disk of its own, rank 0 publishes a
step that lacks that host's shards: saved "successfully", unusable. So before the first step one rank per host (the
first to claim the host in the job's store) writes a token named by its host into each directory; after an exchange
rank 0 looks for every host's token and each of those ranks for rank 0's host's. A host whose token rank 0 cannot
see, or that cannot see rank 0's host's, does not share the directory. Tokens are removed again. A file system that
shows a new file late (NFS attribute caching) gets ``SETTLE_S`` seconds before a missing token counts.

Issue 43: one token per host and 2H look-ups per directory (rank 0's H, one per host), with the exchanges gathered
to rank 0 over the store (engine/cluster/exchange.py); it was a token per rank, every rank looking up every
rank's (2N^2 look-ups: 34 M at 4,096 ranks) and every rank's view gathered to every rank.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.cluster.exchange import run_steps

SETTLE_S = 10.0
_PREFIX = ".shared-"


def _token_name(host: str, token: str) -> str:
    return f"{_PREFIX}{host}-{token}"


def _write(directory: Path, name: str) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("token\n")
        return True
    except OSError:
        return False


def _seen(directory: Path, names: list[str]) -> list[int]:
    """The indices of ``names`` whose file is in ``directory``, looked up by name (each pass only the ones not yet
    seen), waiting SETTLE_S for late ones."""
    deadline, seen = time.monotonic() + SETTLE_S, set()
    while True:
        seen |= {i for i, name in enumerate(names) if i not in seen and (directory / name).exists()}
        if len(seen) == len(names) or time.monotonic() > deadline:
            return sorted(seen)
        time.sleep(0.5)


def run_directories(out: Path, root: Path | None) -> list[tuple[Path, str]]:
    """(path, config key) of the directories every host must share: train.out_dir (``out``), and checkpoint.dir
    (``root``) unless none is saved or it is out_dir itself."""
    return [(out, "train.out_dir")] + ([(root, "checkpoint.dir")] if root and root.resolve() != out.resolve() else [])


def check_shared(
    directories: list[tuple[Path, str]], token: str, exchange, host: str | None = None
) -> tuple[list[str] | None, str | None]:
    """Every rank: ``directories`` are (path, config key); ``exchange`` an engine/cluster/exchange.py
    StoreExchange over the world. Returns (on rank 0 the host of each rank, elsewhere None) and the refusal line
    (None when every directory is shared), the same on every rank."""
    return run_steps(shared_steps(directories, token, exchange, host or socket.gethostname()))


def shared_steps(directories: list[tuple[Path, str]], token: str, exchange, host: str):
    """check_shared as steps: it yields the kind of each exchange before making it (engine/cluster/exchange.py
    ``lockstep`` runs many simulated ranks in one thread: launch/bench/scale.py)."""
    leader = exchange.claim(f"shared-{token}-{host}")
    written = [_write(d, _token_name(host, token)) if leader else False for d, _ in directories]
    yield "gather"
    hosts = exchange.gather(host)  # after it every token is written
    unseen = None
    if exchange.rank == 0:
        order = list(dict.fromkeys(hosts))
        unseen = [sorted(set(order) - _seen_hosts(d, order, token)) for d, _ in directories]
    yield "broadcast"
    first = exchange.broadcast(host)
    view = [ok and _seen(d, [_token_name(first, token)]) == [0] for (d, _), ok in zip(directories, written)]
    yield "gather"
    views = exchange.gather((host, view) if leader else None)
    error = _verdict(directories, hosts, unseen, views) if exchange.rank == 0 else None
    yield "broadcast"
    error = exchange.broadcast(error)
    if leader:
        for (d, _), ok in zip(directories, written):
            if ok:
                (d / _token_name(host, token)).unlink(missing_ok=True)
        exchange.release(f"shared-{token}-{host}")
    return hosts, error


def _seen_hosts(directory: Path, hosts: list[str], token: str) -> set[str]:
    return {hosts[i] for i in _seen(directory, [_token_name(h, token) for h in hosts])}


def _verdict(directories, hosts: list[str], unseen: list[list[str]], views: list) -> str | None:
    """Rank 0: the refusal for the first directory that a host does not share: rank 0 does not see the host's
    token, or the host's token writer does not see rank 0's host's."""
    for i, (directory, setting) in enumerate(directories):
        blind = {v[0] for v in views if v is not None and not v[1][i]}
        bad = [h for h in dict.fromkeys(hosts) if h in blind or h in unseen[i]]
        if bad:
            return _refusal(setting, directory, bad, hosts[0])
    return None


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
