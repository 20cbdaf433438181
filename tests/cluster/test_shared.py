"""The shared-directory check (engine/cluster/shared.py) at a few ranks, without hosts: the start-up check's steps
in lockstep over one in-process store (launch/bench/scale.py ``simulate``), a host's own disk given as another
path for its ranks; preflight's over ssh with an "ssh" that runs the command here, a host's own disk being the
same path rewritten to another folder. tests/cluster/test_shared_scale.py counts the check at 1,024 ranks,
tests/cluster/test_hosts.py runs it on namespace hosts."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import torch.distributed as dist

from engine.cluster import shared
from engine.cluster.exchange import StoreExchange
from launch.bench.scale import simulate


def _check(tmp_path: Path, hosts: list[str], own: dict[str, str] | None = None):
    """Every rank's (hosts, error) for train.out_dir and checkpoint.dir; ``own``: host -> the directory (out or
    ckpt) that is a disk of its own there."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def steps(exchange, rank):
        host = hosts[rank]
        disk = tmp_path / "own" / host
        directories = [
            (disk / "out" if (own or {}).get(host) == "out" else out, "train.out_dir"),
            (disk / "ckpt" if (own or {}).get(host) == "ckpt" else ckpt, "checkpoint.dir"),
        ]
        return shared.shared_steps(directories, "t0k", exchange, host)

    return simulate(len(hosts), steps)[1]


def test_shared_directories_pass_and_every_rank_gets_no_error(tmp_path):
    results = _check(tmp_path, ["h1", "h1", "h2", "h2", "h3"])
    assert results[0] == (["h1", "h1", "h2", "h2", "h3"], None)
    assert all(result == (None, None) for result in results[1:])
    assert not list((tmp_path / "out").iterdir()) and not list((tmp_path / "ckpt").iterdir())  # tokens removed


def test_the_first_directory_not_shared_is_named_with_its_hosts_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SETTLE_S", 0.2)  # a missing token is waited for: briefly here
    results = _check(tmp_path, ["h1", "h2", "h2", "h3", "h4"], own={"h2": "ckpt", "h4": "out"})
    line = (
        f"train.out_dir '{tmp_path / 'out'}' is not shared by host(s) h4: rank 0 (on h1) and their ranks do not "
        f"see each other's files there, so a checkpoint would lack their shards; give a directory on a file system "
        f"every host mounts"
    )
    assert [error for _, error in results] == [line] * 5
    results = _check(tmp_path, ["h1", "h2", "h2", "h3", "h3"], own={"h2": "ckpt", "h3": "ckpt"})
    assert {error for _, error in results} == {
        f"checkpoint.dir '{tmp_path / 'ckpt'}' is not shared by host(s) h2, h3: rank 0 (on h1) and their ranks do "
        f"not see each other's files there, so a checkpoint would lack their shards; give a directory on a file "
        f"system every host mounts"
    }
    for host in ("h2", "h3"):
        assert not list((tmp_path / "own" / host / "ckpt").iterdir())  # its token removed too


def test_a_host_that_sees_rank_0s_token_but_whose_own_is_not_seen_is_not_shared(tmp_path, monkeypatch):
    """One way only (a local overlay over the shared folder, a cache): h2 sees rank 0's host's token and rank 0 not
    h2's, or the other way round; refused all the same."""
    monkeypatch.setattr(shared, "SETTLE_S", 0.2)
    own = tmp_path / "own" / "h2" / "out"
    own.mkdir(parents=True)
    (own / ".shared-h1-t0k").write_text("token\n")  # h1's token, as h2 sees it there
    results = _check(tmp_path, ["h1", "h2"], own={"h2": "out"})
    assert results[1][1].startswith(f"train.out_dir '{tmp_path / 'out'}' is not shared by host(s) h2: ")
    (own / ".shared-h1-t0k").unlink()
    (tmp_path / "out" / ".shared-h2-t0k").write_text("token\n")  # the other way: rank 0 sees h2's, h2 not h1's
    results = _check(tmp_path, ["h1", "h2"], own={"h2": "out"})
    assert results[1][1].startswith(f"train.out_dir '{tmp_path / 'out'}' is not shared by host(s) h2: ")


def test_a_directory_a_host_cannot_write_is_not_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SETTLE_S", 0.2)
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "h2").write_text("a file where the host's folder would be")  # mkdir fails: OSError
    results = _check(tmp_path, ["h1", "h2"], own={"h2": "out"})
    assert results[1][1].startswith(f"train.out_dir '{tmp_path / 'out'}' is not shared by host(s) h2: ")


def test_the_directories_checked():
    out = Path("run")
    assert shared.run_directories(out, None) == [(out, "train.out_dir")]
    assert shared.run_directories(out, Path("run/../run")) == [(out, "train.out_dir")]
    assert shared.run_directories(out, Path("ckpt")) == [(out, "train.out_dir"), (Path("ckpt"), "checkpoint.dir")]


def test_hosts_are_described_with_their_ranks_as_runs():
    assert shared.describe_hosts(["a", "a", "b", "b", "a", "c"]) == "hosts: a ranks 0-1,4, b ranks 2-3, c ranks 5"
    assert shared.describe_hosts(["a", "a"]) is None
    assert shared.describe_hosts(["a", "b"]) == "hosts: a ranks 0, b ranks 1"


# "ssh HOST COMMAND" run here after a login banner; a host named own-* mounts its own disk at the checked path (the
# path rewritten), one named hung-* never answers
FAKE_SSH = (
    'echo "Welcome to $1" >&2; case "$1" in own-*) exec sh -c "$(printf %s "$2" | sed "s#{root}#{root}/$1#g")";; '
    'hung-*) exec sleep 30;; esac; exec sh -c "$2"'
)


def test_preflight_over_ssh_names_the_hosts_that_do_not_see_the_first_hosts_file(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(shared, "SETTLE_S", 0.5)  # one look for a missing file
    ssh = ["sh", "-c", FAKE_SSH.format(root=tmp_path / "shared"), "ssh"]
    directories = [(tmp_path / "shared" / "out", "train.out_dir"), (tmp_path / "shared" / "ckpt", "checkpoint.dir")]
    assert shared.check_shared_over_ssh(ssh, ["h1", "h2", "h3"], directories, 30) is None
    line = shared.check_shared_over_ssh(ssh, ["h1", "own-a", "h2", "own-b"], directories, 30)
    assert line == shared._refusal("train.out_dir", directories[0][0], ["own-a", "own-b"], "h1")
    assert not [p for p in (tmp_path / "shared").rglob("*") if p.name.startswith(".shared-")]  # removed
    (tmp_path / "file").write_text("")
    assert shared.check_shared_over_ssh(ssh, ["h1", "h2"], [(tmp_path / "file" / "d", "train.out_dir")], 30) == (
        f"train.out_dir '{tmp_path / 'file' / 'd'}' cannot be written on h1"
    )
    line = shared.check_shared_over_ssh(ssh, ["h1", "h2", "hung-a"], directories, 2)  # hung-a: past the timeout
    assert line == shared._refusal("train.out_dir", directories[0][0], ["hung-a"], "h1")
    assert capfd.readouterr() == ("", "")  # the hosts' output (banners) is not preflight's


def test_one_rank_checks_under_its_own_host_name(tmp_path):
    """check_shared as the checkpointer calls it (no host given: this machine's name), on a one-rank store."""
    exchange = StoreExchange(dist.HashStore(), 0, 1, 10.0, "check")
    out = tmp_path / "out"
    assert shared.check_shared([(out, "train.out_dir")], "t0k", exchange) == ([socket.gethostname()], None)
    assert out.is_dir() and not list(out.iterdir())  # created, its token removed


def test_a_token_that_shows_late_is_waited_for(tmp_path):
    """A file system that shows a new file late (NFS attribute caching): the token seen 0.3 s after the first look
    counts (SETTLE_S, 10 s, bounds the wait)."""
    late = threading.Timer(0.3, (tmp_path / "late").write_text, ["token\n"])
    late.start()
    try:
        assert shared._seen(tmp_path, ["late"]) == [0]
    finally:
        late.join()
