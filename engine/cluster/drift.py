"""Start-up: every host runs the same packages, engine code and effective config, or every rank refuses in one line.

A host launched with another ``--train.lr``, a stale or edited checkout, or another torch trains without an error:
its replicas drift apart (the loss 8 % off by step 24 in issue 42) and the checkpoint mixes them. So once every rank
has joined the job's store (engine/cluster/startup.py) and before the process group or the model exist, the ranks
compare what they would run:

- ``packages``: Python, torch and hostreport.PACKAGES (transformers, deepspeed, ...), from metadata;
- ``code``: a digest per ``.py`` file of the engine package this process imported (hostreport.file_digests, the
  tree preflight compares over ssh);
- ``config``: the effective config after the YAML file, the CLI overrides and the HF folder's shape
  (``Config.to_dict``). No key is exempt: none may differ per host without changing what a rank computes or
  which collectives it joins (``log.every``, ``train.eval_every``) or where it writes (paths; the directories
  must be the same ones, engine/cluster/shared.py); the launchers give every host the same command line, and the
  rank's identity (RANK, LOCAL_RANK, ``--local_rank``) is no config key.

O(1) store traffic per rank, whatever the world size: rank 0 posts its digests (``ref``) and its details
(``detail``: the config's keys and the files' digests); the first rank of each host (LOCAL_RANK 0: a host's ranks
share its command line, checkout and packages) reads ``ref`` and, only when a digest differs and no line is posted
yet, ``detail``, then compare-sets the one line naming its host and the first differing key; every rank counts
itself in, the last one posts ``done``, and each reads the line (if any) after it. Every rank of every host then
refuses with the same line (ConfigError: exit 2) before any collective, training step or checkpoint write.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from engine.cluster import hostreport
from engine.cluster.heartbeat import host_name, launch_round
from engine.cluster.startup import StartupError
from engine.errors import ConfigError

_PREFIX = "engine-drift"
_SERVING_WAIT_S = 5.0  # the store's host waits this long for every rank to read the line before it exits


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _flat(tree: dict, prefix: str = "") -> dict:
    """{'train.lr': 0.0003, ...}: the config's keys dotted, as the command line spells them."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def packages() -> dict:
    """Python, torch and the packages preflight compares (None: not installed)."""
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    return found | hostreport.package_versions()


def engine_files() -> dict:
    """{path under engine/: digest} of the engine package this process runs."""
    import engine

    return hostreport.file_digests(Path(engine.__file__).resolve().parent)


def describe(config: dict) -> tuple[dict, dict]:
    """(digests, details) of this rank: what every host compares, and what names the first difference."""
    details = {"packages": packages(), "code": engine_files(), "config": _flat(config)}
    digests = {kind: _sha(json.dumps(value, sort_keys=True)) for kind, value in details.items()}
    return digests | {"host": host_name()}, details


def first_difference(kind: str, mine: dict, theirs: dict) -> str:
    """'train.lr 0.001 != 0.0003' (this host's value first), 'engine/trainer.py differs', 'torch 2.5 != 2.6'."""

    def show(value) -> str:
        if kind == "packages":
            return "(not installed)" if value is None else str(value)
        return json.dumps(value)  # a config value as JSON: '' and "0700" stay visible strings

    for key in sorted(set(mine) | set(theirs)):
        if kind == "code" and (key not in mine or key not in theirs):
            return f"engine/{key} {'only here' if key in mine else 'missing here'}"
        if key not in mine or key not in theirs or mine[key] != theirs[key]:
            if kind == "code":
                return f"engine/{key} differs (sha256 {mine[key]} != {theirs[key]})"
            return f"{key} {show(mine.get(key))} != {show(theirs.get(key))}"
    return "the digests differ"  # unreachable while both sides hash the same details


_WHAT = {"packages": "other package versions", "code": "another engine checkout", "config": "another config"}


def refusal(digests: dict, details: dict, ref: dict, ref_details: dict) -> str:
    """The line for a host whose digests differ from rank 0's ``ref`` (packages, then code, then config: a config
    that differs only because a default changed in the code is named by its cause)."""
    kind = next(k for k in ("packages", "code", "config") if digests[k] != ref[k])
    where = first_difference(kind, details[kind], ref_details[kind])
    return (
        f"host {digests['host']} runs {_WHAT[kind]} than host {ref['host']}: {where}; launch every host "
        f"with the same command line, engine checkout and packages"
    )


def check_same(store, rank: int, world: int, config: dict, timeout_s: float) -> None:
    """Every rank, once all have joined ``store`` (the job's store, raw): ConfigError with the same line on every
    rank when any host's packages, engine code or ``config`` differ from rank 0's; StartupError when a rank
    that joined never counts itself in within the store's timeout (``timeout_s``)."""
    import torch.distributed as dist

    ours = dist.PrefixStore(f"{_PREFIX}/{launch_round()}", store)  # a restarted round may share the store
    digests, details = describe(config)
    try:
        if rank == 0:
            ours.set("detail", json.dumps(details))
            ours.set("ref", json.dumps(digests))
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            ref = json.loads(ours.get("ref"))  # waits for rank 0 (the store's timeout: startup_timeout_s)
            if any(digests[k] != ref[k] for k in ("packages", "code", "config")) and not ours.check(["line"]):
                line = refusal(digests, details, ref, json.loads(ours.get("detail")))
                ours.compare_set("line", "", line)
        if ours.add("checked", 1) == world:
            ours.set("done", "1")
        ours.wait(["done"])
        line = ours.get("line").decode() if ours.check(["line"]) else ""
    except (RuntimeError, dist.DistError) as e:  # a rank that joined died before it counted itself in
        raise StartupError(
            f"rank {rank} on host {digests['host']}: the hosts' config, code and packages were not compared "
            f"within {timeout_s:.0f} s (parallel.startup_timeout_s): a rank died or hung after joining "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from None
    if line:
        _leave(ours, rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True", world)
        raise ConfigError(line)


def _leave(ours, serving: bool, world: int) -> None:
    """Count this rank out; the rank serving the store waits (_SERVING_WAIT_S at most) until every rank has read
    the line, so none meets a closed store instead."""
    left, deadline = ours.add("left", 1), time.monotonic() + _SERVING_WAIT_S
    while serving and left < world and time.monotonic() < deadline:
        time.sleep(0.1)
        left = ours.add("left", 0)
