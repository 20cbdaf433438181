"""launch/gpu_check.py: its CPU dry run end to end (the report written and parsed back, CUDA-only measurements
skipped, the verdict computed from the cases), and the loss verdict against its bound."""

import math
import subprocess
import sys

import pytest

from launch.gpu_check import loss_verdict, parse_report
from tests.cli import ROOT


def test_loss_verdict_is_computed_against_the_bound():
    ref = [8.0, 7.5, 7.0]
    assert loss_verdict([8.0, 7.5, 7.0006], ref, 1e-4)[0] == "PASS"  # 0.86e-4 relative
    assert loss_verdict([8.0, 7.5, 7.0008], ref, 1e-4)[0] == "FAIL"  # 1.14e-4
    assert loss_verdict([8.0, 7.5, math.nan], ref, 1.0)[0] == "FAIL"
    assert loss_verdict([8.0, 7.5], ref, 1.0)[0] == "FAIL"  # a step missing


@pytest.mark.slow  # 28 case processes (~26 s); run it when launch/gpu_check.py changes
def test_dry_run_writes_a_report_whose_verdict_comes_from_the_cases(tmp_path):
    """Four case processes (the CPU reference, a feature, an injected case with another seed whose loss must
    differ, one measured memory cell); the llama-3.2-1b predictions and throughput are skipped without CUDA."""
    report = tmp_path / "report.txt"
    cmd = [
        sys.executable,
        str(ROOT / "launch/gpu_check.py"),
        "--dry-run",
        "--out",
        str(report),
        "--only",
        "smoke/fp32-ac_selective",
        "--only",
        "extra-",
        "--extra",
        "other_seed=--train.seed 99",
        "--only",
        "memory/",
        "--only",
        "memory-cpu/ac=full,mbs=4",
        "--only",
        "throughput/",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the injected case fails the verdict
    rows, verdict = parse_report(report.read_text())
    status = {r["name"]: r["status"] for r in rows}
    assert verdict == "FAIL"
    assert [n for n, s in status.items() if s == "FAIL"] == ["smoke/extra-other_seed"], proc.stdout
    assert status["smoke/fp32-ac_selective"] == "PASS"
    assert status["memory-cpu/ac=full,mbs=4"] == "PASS"
    skipped = [r for r in rows if r["status"] == "SKIP"]
    assert sorted(r["name"] for r in skipped) == sorted(
        [f"memory/ac={ac},mbs={m}" for ac in ("none", "selective", "full") for m in (1, 4)]
        + ["throughput/seq2048", "throughput/seq4096"]
    )
    assert all("skipped: no CUDA" in r["detail"] for r in skipped)
    assert all(" GB " in r["detail"] for r in skipped if r["name"].startswith("memory/"))  # the prediction
    assert f"{len(rows) - len(skipped) - 1} PASS" in report.read_text()  # the count on the verdict line


def test_without_cuda_it_says_so_in_one_line(tmp_path):
    """Not a dry run and no CUDA (the test session hides it): exit status 2 and one line, no report."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch/gpu_check.py"), "--out", str(tmp_path / "r.txt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--dry-run" in proc.stderr
    assert not (tmp_path / "r.txt").exists()
