"""What one host would run a job with: Python, torch, the engine checkout and the config file, as one JSON line.

Preflight (launch/preflight.py) sends this file's text to every host as ``ssh HOST PYTHON - ROOT CONFIG`` (the
script on stdin) and compares the answers with the local one, so it must run on a host that has no engine at all:
standard library only, torch imported inside a try. Also runnable here: ``python engine/cluster/hostreport.py ROOT
CONFIG``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import socket
import sys
from pathlib import Path

# Packages whose versions must agree across hosts besides torch (read from metadata, without importing them).
PACKAGES = ("transformers", "deepspeed", "safetensors", "datasets", "tokenizers")


def file_digests(root: Path) -> dict:
    """{relative path: sha256} of the engine package's .py files (the start-up check names the first that differs,
    engine/cluster/drift.py)."""
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        for path in sorted(root.rglob("*.py"))
    }


def _digest_tree(root: Path) -> str:
    """sha256 over the engine package's .py files (relative path and digest), so a host with a stale or edited
    checkout differs even where the version string is the same."""
    return hashlib.sha256(json.dumps(file_digests(root), sort_keys=True).encode()).hexdigest()[:16]


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict:
    """{package: version or None} of PACKAGES, from metadata."""
    return {p: _version(p) for p in PACKAGES}


def _torch() -> dict:
    try:
        import torch
    except Exception as e:  # a broken install raises more than ImportError
        return {"error": f"{type(e).__name__}: {e}"}
    return {"version": torch.__version__, "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def _engine(root: Path) -> dict:
    if not (root / "launch" / "pretrain.py").is_file() or not (root / "engine").is_dir():
        return {"error": f"no engine checkout at {root} (launch/pretrain.py or engine/ is missing)"}
    sys.path.insert(0, str(root))  # as launch/pretrain.py does: the checkout wins over an installed copy
    try:
        import engine.config  # noqa: F401  (imports pyyaml too, which every rank needs)
    except Exception as e:
        return {"error": f"cannot import the engine from {root}: {type(e).__name__}: {e}"}
    return {"version": _version("engine"), "digest": _digest_tree(root / "engine")}


def resolve(names: list[str]) -> dict:
    """{name: its non-loopback addresses here, sorted}: what this host's ranks and torchrun agent would connect to
    for each host of the job (a host's own name at 127.0.1.1 is netcheck's case, not a difference)."""
    found = {}
    for name in names:
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
        except OSError:
            found[name] = []
            continue
        addrs = {info[4][0] for info in infos}
        found[name] = sorted(a for a in addrs if not a.startswith("127.") and a != "::1")
    return found


def report(root: str, config: str = "", names: tuple[str, ...] = ()) -> dict:
    """The host's answers; ``config`` is an absolute path ('' = none to check); ``names``: the job's host names,
    resolved here."""
    out = {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": _torch(),
        "engine": _engine(Path(root)),
        "packages": package_versions(),
        "resolves": resolve(list(names)),
    }
    if "error" not in out["engine"]:  # the address gloo would advertise here (engine/cluster/netcheck.py)
        from engine.cluster.netcheck import my_record

        out["net"] = my_record()
    if config:
        path = Path(config)
        out["config"] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None
    return out


if __name__ == "__main__":
    # argv: [script or '-', ROOT, CONFIG?, NAME...] ('' for no CONFIG before names)
    print(json.dumps(report(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", tuple(sys.argv[3:]))), flush=True)
