"""engine/cluster/hostreport.py's answers where a host's checkout or packages differ from this one's: a checkout that
lacks one of its two parts, an edited checkout whose engine does not import (the checkout on the command line, not
an installed copy, is what the host reports), a package its metadata does not know, and the script run by hand with
a root and a config only (tests/cluster/test_hostcheck.py covers the rest)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cluster import hostreport
from engine.cluster.hostcheck import compare
from tests.cli import ROOT


def test_a_checkout_missing_either_part_is_no_checkout(tmp_path):
    """launch/pretrain.py without engine/, or engine/ without launch/pretrain.py: either is not a checkout."""
    only_launch, only_engine = tmp_path / "launch_only", tmp_path / "engine_only"
    (only_launch / "launch").mkdir(parents=True)
    (only_launch / "launch" / "pretrain.py").write_text("")
    (only_engine / "engine").mkdir(parents=True)
    for root in (only_launch, only_engine):
        assert hostreport.report(str(root))["engine"] == {
            "error": f"no engine checkout at {root} (launch/pretrain.py or engine/ is missing)"
        }


def test_a_package_the_metadata_does_not_know_is_none():
    """A host without deepspeed (say) reports None for it, so preflight names the difference."""
    assert hostreport._version("no-such-package-on-any-host") is None
    assert hostreport._version("torch") == hostreport.package_versions().get("torch", hostreport._version("torch"))


def test_the_checkout_named_is_imported_not_the_working_folders(tmp_path):
    """A host whose checkout was edited so that its engine no longer imports says so, although ssh's working folder
    (sys.path[0] of a script on stdin) holds a working engine, as a home folder that is another checkout does: the
    named checkout goes first on sys.path, as launch/pretrain.py puts it. With a root and a config only (no host
    names), the config's digest is reported."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "engine", checkout / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "launch").mkdir()
    (checkout / "launch" / "pretrain.py").write_text("")
    (checkout / "engine" / "config.py").write_text("raise ImportError('an edit that broke the checkout')\n")
    config = ROOT / "configs" / "tiny.yaml"
    out = subprocess.run(
        [sys.executable, "-", str(checkout), str(config)],
        input=Path(hostreport.__file__).read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,  # a working engine in the working folder
    )
    report = json.loads(out.stdout)
    assert report["engine"] == {
        "error": f"cannot import the engine from {checkout}: ImportError: an edit that broke the checkout"
    }
    assert report["config"] == hashlib.sha256(config.read_bytes()).hexdigest()[:16]


def test_a_host_without_cuda_reports_no_devices_and_any_slot_count_passes():
    """A CPU host (gloo) reports 0 CUDA devices, so preflight never refuses its slots for lack of GPUs; a count of
    one there would refuse every CPU host with slots=2 ("slots=2 but only 1 CUDA devices"). GPU hosts: the count
    against the slots is test_hostcheck.py's."""
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA devices")
    rep = hostreport.report(str(ROOT))
    assert rep["torch"]["cuda_devices"] == 0, rep["torch"]
    assert compare(rep, rep, 4, "") == []


def test_a_gpu_host_reports_its_cuda_devices_and_too_few_for_its_slots_is_refused(monkeypatch):
    """A GPU host (torch sees CUDA, here 4 devices: torch's own answers set, the report and the check are real)
    reports its device count, and preflight refuses slots=8 on it, naming both numbers; on this CPU machine the
    count was never read (a report of 0 devices everywhere would pass any slot count)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    rep = hostreport.report(str(ROOT))
    assert rep["torch"]["cuda_devices"] == 4, rep["torch"]
    assert compare(rep, rep, 4, "") == []
    refused = compare(rep, rep, 8, "")
    assert len(refused) == 1 and "slots=8" in refused[0] and "4 CUDA devices" in refused[0], refused
