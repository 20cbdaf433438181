"""Preflight's host checks (engine/cluster/hostcheck.py, engine/cluster/hostreport.py) in this process, in seconds:
the hosts answer through an "ssh" stand-in with this host's real report, edited as another machine's would differ
(its name, its gloo address, how it resolves the job's host names); hostreport.py itself runs as preflight sends
it (a script on stdin). tests/cluster/test_preflight.py runs launch/preflight.py over fake and real
ssh, tests/cluster/test_hosts.py on namespace hosts."""

from __future__ import annotations

import copy
import functools
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cluster import hostcheck, hostreport
from engine.cluster.hostfile import Host
from engine.config import ConfigError
from tests.cli import ROOT


@functools.cache
def _report(config: str = "") -> dict:
    return hostreport.report(str(ROOT), config)


def _ssh(tmp_path: Path, edits: dict[str, dict], config: str = "") -> list[str]:
    """`ssh HOST COMMAND` that answers with this host's report (its command not run: the report is this process's,
    as the script would print it here) edited as HOST's would differ."""
    folder = tmp_path / "reports"
    folder.mkdir(parents=True)
    for host in ("a", "b", "c", *edits):
        (folder / f"{host}.json").write_text(json.dumps({**_report(config), **edits.get(host, {})}))
    return ["sh", "-c", f'cat {folder}/"$1".json', "ssh"]


def _hosts(*names: str) -> list[Host]:
    return [Host(name, 1, i + 1) for i, name in enumerate(names)]


def _net(host: str, addr: str) -> dict:
    return {"net": {"host": host, "addr": addr, "iface": "eth0"}, "host": host}


def test_a_loopback_name_fails_its_host_only_when_the_hosts_are_two_machines(tmp_path):
    ssh = _ssh(tmp_path, {"a": _net("ma", "198.18.0.1"), "b": _net("mb", "127.0.1.1"), "c": _net("mc", "198.18.0.3")})
    results = hostcheck.check_hosts(_hosts("a", "b", "c"), ssh, str(ROOT), timeout_s=60)
    assert [r.problems for r in results] == [
        [],
        [
            "its host name resolves to 127.0.1.1, a loopback address, so the other hosts would connect to themselves "
            "(gloo: Connection refused); set GLOO_SOCKET_IFNAME=eth0 (and NCCL_SOCKET_IFNAME=eth0 under nccl) for "
            "every rank - under the deepspeed launcher as lines in .deepspeed_env - or map mb to its network "
            "address in /etc/hosts"
        ],
        [],
    ]
    assert hostcheck.describe(results[1]).startswith("FAIL b: its host name resolves to 127.0.1.1")
    # the first host's own loopback name counts as much; two hostfile lines on one machine are one machine
    ssh = _ssh(tmp_path / "first", {"a": _net("ma", "127.0.1.1"), "b": _net("mb", "198.18.0.2")})
    assert [bool(r.problems) for r in hostcheck.check_hosts(_hosts("a", "b"), ssh, str(ROOT))] == [True, False]
    ssh = _ssh(tmp_path / "one", {"a": _net("m", "127.0.1.1"), "b": _net("m", "127.0.1.1")})
    assert [r.problems for r in hostcheck.check_hosts(_hosts("a", "b"), ssh, str(ROOT))] == [[], []]


def test_a_host_that_resolves_a_name_elsewhere_is_named_once(tmp_path):
    first = {"resolves": {"a": ["10.0.0.1"], "b": ["10.0.0.2"], "c": ["10.0.0.3"]}}
    ssh = _ssh(
        tmp_path,
        {
            "a": first,
            "b": {"resolves": {"a": ["10.0.0.1"], "b": ["10.0.0.2"], "c": ["10.0.0.3"]}},
            "c": {"resolves": {"a": ["10.0.0.9"], "b": [], "c": ["10.0.0.3"]}},  # two names differ: one line
        },
    )
    results = hostcheck.check_hosts(_hosts("a", "b", "c"), ssh, str(ROOT))
    assert [r.problems for r in results] == [
        [],
        [],
        [
            "resolves host name a to 10.0.0.9 where a resolves it to 10.0.0.1: its ranks and torchrun agent would "
            "connect elsewhere; make /etc/hosts or DNS agree on every host"
        ],
    ]
    ssh = _ssh(tmp_path / "x", {"b": {"resolves": {"a": []}}, "a": {"resolves": {"a": ["10.0.0.1"]}}})
    assert hostcheck.check_hosts(_hosts("a", "b"), ssh, str(ROOT))[1].problems == [
        "resolves host name a to nothing where a resolves it to 10.0.0.1: its ranks and torchrun agent would "
        "connect elsewhere; make /etc/hosts or DNS agree on every host"
    ]


def test_hosts_that_answer_the_same_pass_and_describe_what_they_run(tmp_path):
    config = ROOT / "configs" / "tiny.yaml"
    results = hostcheck.check_hosts(_hosts("a", "b"), _ssh(tmp_path, {}, str(config)), str(ROOT), str(config))
    assert [r.problems for r in results] == [[], []]
    rep = results[0].report
    line = hostcheck.describe(results[0])
    assert line.startswith(f"ok   a ({rep['host']}): python {platform.python_version()}, torch ")
    assert line.endswith(f"[{rep['engine']['digest']}], {rep['torch']['cuda_devices']} CUDA devices, slots=1")


def test_what_differs_on_a_host_is_named(tmp_path):
    config = str(ROOT / "configs" / "tiny.yaml")
    local = hostreport.report(str(ROOT), config)
    assert hostcheck.compare(local, copy.deepcopy(local), 1, config) == []
    remote = copy.deepcopy(local)
    remote.update(python="3.9.1", config="0" * 16)
    remote["torch"]["version"] = "1.0"
    remote["engine"]["digest"] = "f" * 16
    remote["packages"]["deepspeed"] = "0.1"
    remote["torch"]["cuda_devices"] = 2
    assert hostcheck.compare(local, remote, 3, config) == [
        f"Python 3.9.1 != {local['python']} here",
        f"torch 1.0 != {local['torch']['version']} here",
        f"engine source differs from this checkout (digest {'f' * 16} != {local['engine']['digest']}); sync the "
        "checkout",
        f"deepspeed 0.1 != {local['packages']['deepspeed']} here",
        "slots=3 but only 2 CUDA devices",
        f"config file {config} differs from the local copy",
    ]
    assert hostcheck.compare(local, remote, 2, "")[-1] == f"deepspeed 0.1 != {local['packages']['deepspeed']} here"
    remote = copy.deepcopy(local)
    remote.update(config=None, torch={"error": "ImportError: no torch"}, engine={"error": "no engine checkout at x"})
    remote["engine"]["version"] = "other"
    assert hostcheck.compare(local, remote, 2, config) == [  # no torch: no CUDA devices claimed either
        "ImportError: no torch",
        "no engine checkout at x",
        f"config file {config} does not exist there",
    ]
    remote = copy.deepcopy(local)
    remote["engine"]["version"] = "9.9"
    assert hostcheck.compare(local, remote, 1, "") == [f"engine 9.9 != {local['engine']['version']} here"]


FAILURES = {  # the stand-in's shell command -> why the host's report could not be had
    "echo 'ssh: Could not resolve hostname x' >&2; exit 255": "ssh failed: ssh: Could not resolve hostname x",
    "exit 127": f"{sys.executable} not found there; every host needs the same Python at the same path",
    "echo first >&2; echo 'Killed ' >&2; exit 137": "the host report exited 137: Killed",
    "echo 'Welcome'; echo '{not json'": "unreadable host report: '{not json'",
    "exit 1": "the host report exited 1: (no output)",
}


@pytest.mark.parametrize("command", list(FAILURES))
def test_a_host_whose_report_cannot_be_had_says_why(command):
    assert hostcheck.query_host(["sh", "-c", command, "ssh"], "h", str(ROOT), "", 30) == (None, FAILURES[command])


def test_a_report_after_a_login_banner_is_read_and_a_silent_host_is_bounded(tmp_path):
    ssh = ["sh", "-c", 'echo "Welcome to h"; echo; sh -c "$2"', "ssh"]
    report, why = hostcheck.query_host(ssh, "h", str(ROOT), "", 60, ("localhost",))
    assert why == "" and report["resolves"] == {"localhost": []} and report["engine"]["version"]
    assert hostcheck.query_host(["sh", "-c", "sleep 5", "ssh"], "h", str(ROOT), "", 0.4) == (
        None,
        "no answer over ssh within 0 s",
    )
    with pytest.raises(ConfigError, match="the ssh command '/nonexistent/ssh' was not found; give a working one"):
        hostcheck.query_host(["/nonexistent/ssh", "-o", "BatchMode=yes"], "h", str(ROOT), "", 30)


def test_a_fanout_of_one_asks_one_host_at_a_time(tmp_path):
    """--fanout 1 (a bastion or sshd that takes one login at a time): never two ssh commands at once. Each call of the
    stand-in leaves a token while it runs and counts the tokens half a second in; two calls started together would
    count each other's (tests/cluster/test_preflight.py counts larger fan-outs through launch/preflight.py)."""
    run = f"{tmp_path}/run.$$"
    count = f"set -- {tmp_path}/run.*; echo $# >> {tmp_path}/seen"
    ssh = ["sh", "-c", f"touch {run}; sleep 0.5; {count}; rm {run}; echo down >&2; exit 255", "ssh"]
    results = hostcheck.check_hosts(_hosts("a", "b"), ssh, str(ROOT), fanout=1)
    assert [r.problems for r in results] == [["ssh failed: down"]] * 2
    assert (tmp_path / "seen").read_text().split() == ["1", "1"]


def test_remote_commands_get_the_deepspeed_env_of_home_then_the_working_folder(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    assert hostcheck.remote_command(["python", "-"]) == "python -"
    (home / ".deepspeed_env").write_text("A=home\nB=1=2\nnot a setting\n")
    (work / ".deepspeed_env").write_text(" A=work \n")
    assert hostcheck.deepspeed_env() == {"A": "work", "B": "1=2"}
    assert hostcheck.remote_command(["python", "-"]) == "env A=work B=1=2 python -"
    monkeypatch.setenv("DS_ENV_FILE", "other_env")
    assert hostcheck.deepspeed_env() == {}
    (work / "other_env").mkdir()
    assert hostcheck.deepspeed_env() == {}  # a folder of that name is no file
    (home / "other_env").symlink_to("/proc/self/mem")  # a file whose read fails (EIO), even for root
    with pytest.raises(ConfigError, match=re.escape(f"{home / 'other_env'} cannot be read (Input/output error)")):
        hostcheck.deepspeed_env()


def test_the_host_report_is_this_hosts():
    """hostreport.py as preflight runs it on a host: a script on stdin, standard library only."""
    script = Path(hostreport.__file__).read_text()
    config = ROOT / "configs" / "tiny.yaml"
    out = subprocess.run(
        [sys.executable, "-", str(ROOT), str(config), "localhost", "nonexistent.invalid"],
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    report = json.loads(out.stdout)
    assert report["python"] == platform.python_version() and report["executable"] == sys.executable
    assert report["resolves"] == {"localhost": [], "nonexistent.invalid": []}  # loopback addresses left out
    assert report["engine"] == hostreport.report(str(ROOT))["engine"] and len(report["config"]) == 16
    assert report["packages"] == hostreport.package_versions() and "net" in report
    assert hostreport.report(str(ROOT), "/nonexistent.yaml")["config"] is None
    missing = hostreport.report("/nonexistent")
    assert missing["engine"] == {
        "error": "no engine checkout at /nonexistent (launch/pretrain.py or engine/ is missing)"
    }
    assert "net" not in missing


def test_a_host_whose_torch_or_engine_is_broken_says_so_and_names_are_resolved_without_loopback(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    (tmp_path / "yaml.py").write_text("raise SyntaxError('a broken pyyaml')\n")  # the engine imports it
    out = subprocess.run(
        [sys.executable, str(Path(hostreport.__file__)), str(ROOT)],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(out.stdout)
    assert report["torch"] == {"error": "ImportError: libcudart.so.12: cannot open"}
    assert report["engine"] == {"error": f"cannot import the engine from {ROOT}: SyntaxError: a broken pyyaml"}
    assert hostreport.resolve(["nonexistent.invalid", "198.18.0.7", "::1", "127.0.0.2"]) == {
        "nonexistent.invalid": [],  # and the names after it are resolved too
        "198.18.0.7": ["198.18.0.7"],
        "::1": [],
        "127.0.0.2": [],
    }
