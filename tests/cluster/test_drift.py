"""The start-up comparison of the hosts (engine/cluster/drift.py) without hosts: its ranks on threads of this
process, each calling ``check_same`` on its own client of a real TCPStore, as on their own hosts; a rank's config
is what the test gives it. tests/cluster/test_hosts.py runs it on namespace hosts (another --train.lr, an edited
checkout) through torchrun."""

from __future__ import annotations

import functools
import platform
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from engine.cluster import drift
from engine.cluster.startup import StartupError
from engine.errors import ConfigError
from tests.dist import run_threads

CONFIG = {"train": {"lr": 0.0003, "steps": 4}, "log": {"every": 1}, "out_dir": "0700"}


@pytest.fixture
def serve(monkeypatch):
    """A new job's store per call, served in this process; returns its port."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    servers = []

    def start() -> int:
        servers.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        return servers[-1].port

    return start


def _ranks(port: int, configs: list[dict | None], timeout_s: float = 20.0) -> list[str]:
    """Each rank's check_same (None: a rank that joined and never compares): '' or the error it raised. Rank 0
    serves the store (env://): when it refuses, every rank has read the line (counted itself out) already."""
    out = [""] * len(configs)

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
        try:
            drift.check_same(store, r, len(configs), configs[r], timeout_s)
        except (ConfigError, StartupError) as e:
            out[r] = f"{type(e).__name__}: {e}"
            if r == 0 and isinstance(e, ConfigError):  # how many ranks had read the line when rank 0 left
                out[r] += f" (left: {int(store.get(f'{drift._PREFIX}/0/left'))})"

    run_threads([functools.partial(rank, r) for r, c in enumerate(configs) if c is not None])
    return out


def test_same_config_everywhere_passes_and_one_other_value_refuses_every_rank(serve):
    assert _ranks(serve(), [CONFIG] * 3) == [""] * 3
    other = {**CONFIG, "train": {"lr": 0.001, "steps": 4}}
    lines = _ranks(serve(), [CONFIG, CONFIG, other])
    host = drift.host_name()
    line = (
        f"ConfigError: host {host} runs another config than host {host}: train.lr 0.001 != 0.0003; launch every "
        "host with the same command line, engine checkout and packages"
    )
    assert lines == [f"{line} (left: 3)", line, line], lines


def test_a_rank_that_joined_and_never_compares_is_a_startup_error(serve):
    lines = _ranks(serve(), [CONFIG, None], timeout_s=1.0)
    assert lines[0].startswith(
        f"StartupError: rank 0 on host {drift.host_name()}: the hosts' config, code and packages were not compared "
        "within 1 s (parallel.startup_timeout_s): a rank died or hung after joining (wait timeout after 1000ms, keys: "
        f"/{drift._PREFIX}/0/done)"
    ), lines


def test_first_difference_names_the_key_and_both_values():
    assert drift.first_difference("config", {"a": 1, "b": "0700"}, {"a": 1, "b": 700}) == 'b "0700" != 700'
    assert drift.first_difference("config", {"a": 1}, {"a": 1, "z": 2}) == "z null != 2"
    assert drift.first_difference("packages", {"torch": "2.5", "x": None}, {"torch": "2.5", "x": "1"}) == (
        "x (not installed) != 1"
    )
    assert drift.first_difference("code", {"a.py": "1", "b.py": "2"}, {"a.py": "1", "b.py": "3"}) == (
        "engine/b.py differs (sha256 2 != 3)"
    )
    assert drift.first_difference("code", {"a.py": "1", "c.py": "2"}, {"a.py": "1"}) == "engine/c.py only here"
    assert drift.first_difference("code", {"a.py": "1"}, {"a.py": "1", "c.py": "2"}) == "engine/c.py missing here"
    assert drift._flat({"a": {"b": {"c": 1}}, "d": 2}) == {"a.b.c": 1, "d": 2}
    assert drift.packages()["python"] == platform.python_version()  # not the compiler's version beside it


def test_refusal_names_packages_before_code_before_config():
    """A config that differs only because the code's default changed is named by its cause: the code."""
    digests, details = drift.describe(CONFIG)
    code = {**details["code"], "trainer.py": "x"}
    config = {**CONFIG, "log": {"every": 2}}
    ref = {**digests, "host": "h1", "code": drift._sha("other"), "config": drift._sha("other")}
    line = drift.refusal(digests, details, ref, {**details, "code": code, "config": drift._flat(config)})
    assert line.startswith(f"host {digests['host']} runs another engine checkout than host h1: engine/trainer.py ")
    ref["packages"] = drift._sha("other")
    line = drift.refusal(digests, details, ref, {**details, "packages": {**details["packages"], "torch": "0"}})
    assert f"runs other package versions than host h1: torch {details['packages']['torch']} != 0;" in line


def test_the_store_host_waits_only_while_a_rank_has_not_read_the_line(monkeypatch):
    """_leave on a real store, its waits counted (drift's time.sleep): the rank serving the store does not wait once
    every rank has counted itself out (the others before it: it leaves at once, not after _SERVING_WAIT_S, so a
    refused job exits 2 without a pause), and a rank that does not serve never waits, whoever is left."""
    sleeps = []
    monkeypatch.setattr(drift.time, "sleep", lambda s: sleeps.append(s))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ours = dist.PrefixStore("leave", server)
    ours.add("left", 2)  # ranks 1 and 2 have read the line and left
    drift._leave(ours, True, 3)
    assert sleeps == [] and int(ours.get("left")) == 3
    others = dist.PrefixStore("others", server)  # nobody else has left yet: only the serving rank would wait
    drift._leave(others, False, 3)
    assert sleeps == [] and int(others.get("left")) == 1


@pytest.mark.parametrize("agent_store", [False, True])
def test_rank_0_serves_the_store_unless_torchruns_agent_does(serve, monkeypatch, agent_store):
    """Which rank of a refused job waits for the others to read the line (_leave's ``serving``, the real _leave
    called through): rank 0 under env:// (its process holds the store: leaving first would close it on the others),
    no rank when torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE=True: nobody need wait)."""
    if agent_store:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    serving, leave = {}, drift._leave
    monkeypatch.setattr(
        drift, "_leave", lambda ours, s, world: serving.update({threading.get_ident(): s}) or leave(ours, s, world)
    )
    ranks = {}
    real = drift.check_same

    def check(store, rank, *args):
        ranks[threading.get_ident()] = rank
        return real(store, rank, *args)

    monkeypatch.setattr(drift, "check_same", check)
    other = {**CONFIG, "train": {"lr": 0.001, "steps": 4}}
    assert all(_ranks(serve(), [CONFIG, CONFIG, other]))  # every rank refused
    assert sorted((ranks[t], s) for t, s in serving.items()) == [(0, not agent_store), (1, False), (2, False)]
