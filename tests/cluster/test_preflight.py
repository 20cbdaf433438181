"""launch/preflight.py and its parts: the hostfile parser, host checks over (fake and real) ssh, the link test."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cluster.hostfile import Host, HostfileError, parse_hostfile, parse_hostfile_text
from engine.cluster.linktest import link_pairs
from tests.cli import ROOT, one_error_line, run_script
from tests.dist import free_port
from tests.sshd import local_sshd  # noqa: F401  (fixture)

# Stands in for ssh: `fake_ssh HOST COMMAND` runs COMMAND here, as ssh runs it through the remote shell. Host
# "down" is unreachable (ssh's message and exit status 255); host "bare" has no engine checkout but the same
# Python: the checkout's path is rewritten to an empty folder, as on a machine where it was never copied, except
# in the Python's own path (a virtual environment inside the checkout, `python -m venv .venv`, or beside it with
# a name that starts with the checkout's: issue 42 item 12), which is set aside first and put back after.
FAKE_SSH = """#!/bin/sh
host=$1; shift
case "$host" in
  down) echo "ssh: connect to host down port 22: No route to host" >&2; exit 255;;
  bare) exec sh -c "$(printf '%s' "$*" | sed "s#{python}#@PYTHON@#g; s#{root}#{empty}#g; s#@PYTHON@#{python}#g")";;
  *) exec sh -c "$*";;
esac
"""


def write_fake_ssh(folder: Path, root: Path, python: str) -> str:
    """The fake ssh in ``folder``; host "bare" sees ``root`` as ``folder``/empty, and ``python`` where it is."""
    (folder / "empty").mkdir()
    script = folder / "fake_ssh"
    script.write_text(FAKE_SSH.format(root=root, empty=folder / "empty", python=python))
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def fake_ssh(tmp_path) -> str:
    return write_fake_ssh(tmp_path, ROOT, sys.executable)


@pytest.mark.parametrize("venv", [".venv/bin/python", "-venv/bin/python"], ids=["inside", "prefixed"])
def test_fake_ssh_bare_host_keeps_a_python_whose_path_starts_with_the_checkouts(tmp_path, venv):
    """The bare host loses the checkout, not the Python: a virtual environment inside the checkout (or beside it,
    its name starting with the checkout's) is still found there, so preflight reports the missing checkout."""
    root = tmp_path / "checkout"
    python = f"{root}{'/' if venv.startswith('.') else ''}{venv}"
    ssh = write_fake_ssh(tmp_path, root, python)
    command = shlex.join(["echo", python, "-", str(root), f"{root}/configs/tiny.yaml"])
    out = subprocess.run([ssh, "bare", command], capture_output=True, text=True, timeout=30)
    empty = tmp_path / "empty"
    assert out.stdout.split() == [python, "-", str(empty), f"{empty}/configs/tiny.yaml"], out.stdout + out.stderr


def preflight(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch/preflight.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_hostfile_parser_reads_deepspeed_format():
    text = "# cluster\nnode1 slots=8\n\n  node2   slots=4  # spare\nroot@10.0.0.3 slots=1\n"
    assert parse_hostfile_text(text) == [Host("node1", 8, 2), Host("node2", 4, 4), Host("root@10.0.0.3", 1, 5)]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("node1 slots=8\nnode2 slots=x\n", "hosts line 2: 'node2 slots=x' is not valid"),
        ("node1 slots=8\nnode2 slots=4 gpus=2\n", "hosts line 2: 'node2 slots=4 gpus=2' is not valid"),
        ("node1\n", "hosts line 1: 'node1' is not valid"),
        ("node1 slots=0\n", "hosts line 1: 'node1 slots=0' has slots=0"),
        ("node1 slots=2\nnode1 slots=2\n", "hosts line 2: host 'node1' is already listed on line 1"),
        ("# nothing\n\n", "hosts lists no hosts"),
    ],
)
def test_hostfile_errors_name_the_line_and_what_is_valid(text, expected):
    with pytest.raises(HostfileError) as e:
        parse_hostfile_text(text, "hosts")
    assert expected in str(e.value) and "\n" not in str(e.value)
    if "is not valid" in expected:
        assert "HOSTNAME slots=N" in str(e.value)


@pytest.mark.parametrize(
    "host",
    [
        "node1",
        "n-1.cluster_a",
        "root@10.0.0.3",
        "a.b-c@node1",
        "::1",
        "[::1]",
        "[2001:db8::1:2]",
        "a" * 63 + ".b",
        "0" + ".a" * 126,
    ],
)
def test_hostfile_takes_names_users_and_addresses(host):
    assert parse_hostfile_text(f"{host} slots=2\n", "hosts") == [Host(host, 2, 1)]


@pytest.mark.parametrize(
    "host, why",
    [
        ("-oProxyCommand", "it would reach ssh as an option"),
        ("-Elog", "it would reach ssh as an option"),
        (".x@node1", "user '.x' is not a user name"),
        ("@node1", "user '' is not a user name"),
        ("node1-", "it is not a host name or address"),
        ("a..b", "it is not a host name or address"),
        ("a" * 64, "it is not a host name or address"),
        ("0" + ".a" * 125 + ".ab", "it is not a host name or address"),  # 254 characters: DNS allows 253
        ("[node1]", "it is not a host name or address"),
        ("[::1", "it is not a host name or address"),
    ],
)
def test_hostfile_refuses_a_host_ssh_would_read_as_an_option_or_garbage(host, why):
    """DeepSpeed's launcher hands the host to ssh and pdsh: one starting with '-' would be an option there."""
    with pytest.raises(HostfileError) as e:
        parse_hostfile_text(f"node0 slots=1\n{host} slots=2\n", "hosts")
    assert str(e.value) == (
        f"hosts line 2: host {host!r} is not valid ({why}); a host is a name such as node1 or node1.cluster, or an "
        "IPv4/IPv6 address, optionally user@ first"
    )


def test_hostfile_that_is_a_folder_or_not_utf8(tmp_path):
    with pytest.raises(HostfileError, match=f"^hostfile '{tmp_path}' is a directory; give a file with"):
        parse_hostfile(tmp_path)
    (tmp_path / "h").write_bytes(b"node1 slots=1\nn\xffode2 slots=1\n")
    with pytest.raises(HostfileError, match=r"is not UTF-8 text \(byte 15\); each line must be"):
        parse_hostfile(tmp_path / "h")


def test_hostfile_example_parses():
    assert [(h.name, h.slots) for h in parse_hostfile(ROOT / "hostfile.example")] == [("node1", 8), ("node2", 8)]


def test_missing_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")


def test_link_pairs_all_pairs_small_and_host_links_large():
    assert link_pairs(["a", "a", "b"]) == [(0, 1), (0, 2), (1, 2)]
    labels = [f"n{r // 8}" for r in range(32)]  # 4 hosts x 8 ranks
    pairs = link_pairs(labels)
    assert [(a, b) for a, b in pairs if labels[a] != labels[b]] == [
        (0, 8),
        (0, 16),
        (0, 24),
        (8, 16),
        (8, 24),
        (16, 24),
    ]
    assert len(pairs) == 6 + 4 * 7  # plus each host's first rank with its 7 local peers


def test_preflight_malformed_hostfile_exits_2_naming_the_line(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=two\n")
    run = preflight("--hostfile", str(hostfile))
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"error: {hostfile} line 2: 'node2 slots=two' is not valid; each line must be "
        "'HOSTNAME slots=N' with N >= 1 (blank lines and '#' comments are allowed)"
    )


def test_preflight_config_must_fit_the_world(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=3\n")
    run = preflight("--hostfile", str(hostfile), "--config", "configs/tiny.yaml")
    assert run.returncode == 2 and "does not fit 3 processes" in run.stderr, run.stderr


# issue 42: IndexError, shlex's ValueError, UnicodeDecodeError tracebacks. case -> (--ssh, .deepspeed_env, words)
PREFLIGHT_INPUTS = {
    "--ssh ''": ("", None, "--ssh '' names no command; give an ssh command such as 'ssh -o BatchMode=yes"),
    "--ssh with an unclosed quote": (
        "ssh -o 'ProxyCommand=x",
        None,
        '--ssh "ssh -o \'ProxyCommand=x" is not a command line (No closing quotation); close its quotes',
    ),
    ".deepspeed_env not UTF-8": (
        "false",
        b"NCCL_DEBUG=INFO\nA=\xff\xfe\n",
        ".deepspeed_env is not UTF-8 text (byte 18)",
    ),
}


@pytest.mark.parametrize("case", list(PREFLIGHT_INPUTS))
def test_preflight_bad_ssh_or_deepspeed_env_is_one_line(tmp_path, case):
    ssh, env_file, words = PREFLIGHT_INPUTS[case]
    (tmp_path / "hostfile").write_text("node1 slots=1\n")
    if env_file is not None:
        (tmp_path / ".deepspeed_env").write_bytes(env_file)  # read from the working directory, as deepspeed does
    script = str(ROOT / "launch" / "preflight.py")
    out = run_script(script, "--hostfile", "hostfile", "--ssh", ssh, "--skip-links", cwd=tmp_path, timeout=120)
    one_error_line(out, words)


def test_preflight_names_unreachable_host_and_host_without_engine(tmp_path, fake_ssh):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\ndown slots=1\nbare slots=1\n")
    run = preflight("--hostfile", str(hostfile), "--ssh", fake_ssh, "--config", "configs/tiny.yaml")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("ok   localhost") for line in lines), run.stdout
    assert "FAIL down: ssh failed: ssh: connect to host down port 22: No route to host" in lines
    assert any(line.startswith(f"FAIL bare: no engine checkout at {tmp_path / 'empty'}") for line in lines)
    error = run.stderr.strip()
    assert error.startswith("error: host check failed on down (") and ", bare (" in error and "localhost" not in error


def job_config(tmp_path) -> str:
    """configs/tiny.yaml with train.out_dir in tmp_path: preflight's shared-directory check writes a token into the
    job's out_dir on every host (tiny's runs/tiny is in the checkout)."""
    tiny = Path("configs/tiny.yaml").read_text()
    assert "  out_dir: runs/tiny\n" in tiny
    config = tmp_path / "job.yaml"
    config.write_text(tiny.replace("  out_dir: runs/tiny\n", f"  out_dir: {tmp_path / 'run'}\n"))
    return str(config)


def test_preflight_link_test_across_two_hosts(tmp_path, fake_ssh):
    """Two 'hosts' (both this machine through the fake ssh), one torchrun agent each: the p2p link between them
    and the all-reduce are measured and printed, labelled with the hostfile names."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    run = preflight(
        "--hostfile",
        str(hostfile),
        "--ssh",
        fake_ssh,
        "--config",
        job_config(tmp_path),
        "--port",
        str(free_port()),
        "--size-mb",
        "1",
        "--iters",
        "3",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "link test on 127.0.0.1: cd " in out and "--rdzv-backend c10d" in out
    assert "links (gloo, 1.0 MiB messages, 2 ranks):" in out
    p2p = [line for line in out.splitlines() if "p2p rank 0" in line]
    assert len(p2p) == 1 and "<-> rank 1" in p2p[0] and "(localhost)" in out and "(127.0.0.1)" in out
    assert float(p2p[0].split(":")[-1].split()[0]) > 0
    assert "all-reduce over 2 ranks: algbw" in out and out.rstrip().endswith("preflight passed")


def test_preflight_local_link_test():
    """4 ranks: the 6 pairs run in 3 rounds of 2 pairs at once (link_rounds), each measured."""
    run = preflight("--local", "4", "--size-mb", "0.5", "--iters", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    pairs = [line.split(":")[0].strip() for line in run.stdout.splitlines() if "p2p rank" in line]
    assert len(pairs) == 6 and "p2p rank 0 (localhost) <-> rank 3 (localhost)" in pairs
    assert "all-reduce over 4 ranks" in run.stdout


def test_preflight_over_real_ssh(tmp_path, local_sshd):
    """The host checks through a real sshd on loopback with a key: the ssh command comes from --ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run = preflight(
        "--hostfile",
        str(hostfile),
        "--ssh",
        shlex.join(local_sshd.ssh_command()),
        "--config",
        job_config(tmp_path),
        "--skip-links",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert any(line.startswith("ok   localhost (") for line in run.stdout.splitlines()), run.stdout


def test_link_test_failure_names_the_cause_not_torchruns_frame():
    """A failed link test's stderr ends with torchrun's failure summary; the cause is a rank's `error:` line."""
    from launch.preflight import failure_cause

    err = (
        "error: host h2: its host name resolves to 127.0.1.1, a loopback address, ...\n"
        "Traceback (most recent call last):\n  File x\ntorch.distributed.elastic...ChildFailedError:\n"
        "============================================================\n"
    )
    assert failure_cause(err) == "error: host h2: its host name resolves to 127.0.1.1, a loopback address, ..."
    assert failure_cause("RuntimeError: Connection refused\n-----\n=====\n") == "RuntimeError: Connection refused"


def test_link_plan_at_2048_hosts_is_linear_in_rounds_of_disjoint_pairs():
    """At 2,048 hosts x 8 ranks the link test used to measure C(2048, 2) host pairs one at a time; now O(hosts)
    pairs in (slots - 1) + 4 rounds, no rank twice in a round, every host against another in each host round."""
    from engine.cluster.linktest import link_rounds

    hosts, slots = 2048, 8
    labels = [f"h{r // slots}" for r in range(hosts * slots)]
    rounds = link_rounds(labels)
    pairs = [p for r in rounds for p in r]
    assert len(rounds) == (slots - 1) + 4 <= 2 * (hosts.bit_length() - 1)
    assert len(pairs) == hosts * (slots - 1) + 4 * hosts // 2 <= 10 * hosts  # O(hosts); was C(2048, 2) + ...
    for r in rounds:
        ranks = [rank for p in r for rank in p]
        assert len(ranks) == len(set(ranks))  # disjoint: the round's pairs run at once
    host_rounds = [r for r in rounds if all(labels[a] != labels[b] for a, b in r)]
    assert len(host_rounds) == 4
    for r in host_rounds:  # every host measured against another host in every host round
        assert sorted(labels[x] for p in r for x in p) == sorted(set(labels))
    assert len({p for r in host_rounds for p in r}) == 4 * hosts // 2  # no host pair measured twice
    intra = [p for r in rounds for p in r if labels[p[0]] == labels[p[1]]]
    assert len(intra) == hosts * (slots - 1)  # each host's first rank with each of its local ranks


def test_preflight_plan_only_at_2048_hosts():
    run = preflight("--plan-only", "--hosts", "2048")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "host checks: 2048 hosts, 256 at once: 8 waves x 10.0 s = 80.0 s"  # README's default --fanout
    assert lines[1].startswith("link test: 18432 pairs in 11 rounds of disjoint pairs")
    minutes = float(lines[-1].split("(")[1].split()[0])
    assert lines[-1].startswith("preflight estimate at 2048 hosts:") and minutes < 10
    bad = preflight("--plan-only", "--hosts", "2048", "--fanout", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --fanout=0") and "\n" not in bad.stderr.strip()


# Stands in for ssh in the fan-out test: each call leaves a token in a folder while it runs, waits (up to 20 s)
# until WANT calls run at once (shell built-ins only: cheap on a loaded machine), keeps its token a second longer
# (so every call of its wave, which checks every 0.2 s, sees WANT too, rather than waiting out the 20 s when the
# first to see it has gone; and a pool running more than WANT at once is seen doing it), writes how many it saw,
# and fails as an unreachable host does.
COUNTING_SSH = """#!/bin/sh
host=$1; dir={dir}; touch $dir/run.$$; seen=0; i=0
while [ $i -lt 100 ]; do
  set -- $dir/run.*; [ $# -gt $seen ] && seen=$#
  [ $# -ge {want} ] && break
  sleep 0.2; i=$((i + 1))
done
sleep 1; set -- $dir/run.*; [ $# -gt $seen ] && seen=$#
echo $seen >> $dir/seen; rm -f $dir/run.$$
echo "ssh: stand-in for $host" >&2; exit 255
"""


@pytest.mark.parametrize("hosts, fanout", [(12, 4), (40, 40)])
def test_host_checks_run_fanout_at_once(tmp_path, hosts, fanout):
    """The host checks run --fanout ssh commands at once, never more (counted by a real ssh stand-in); 40 at once
    was 32 before, the fixed pool size."""
    folder = tmp_path / "calls"
    folder.mkdir()
    ssh = tmp_path / "counting_ssh"
    ssh.write_text(COUNTING_SSH.format(dir=folder, want=fanout))
    ssh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i} slots=1\n" for i in range(hosts)))
    run = preflight("--hostfile", str(hostfile), "--ssh", str(ssh), "--skip-links", "--fanout", str(fanout))
    assert run.returncode == 1 and "FAIL node0: ssh failed: ssh: stand-in for node0" in run.stdout, run.stderr
    seen = [int(n) for n in (folder / "seen").read_text().split()]
    assert len(seen) == hosts and max(seen) == fanout
