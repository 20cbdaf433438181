"""launch/pretrain.py as a user runs it: a short run works; bad input exits non-zero with one line, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli import ROOT, run_script
from tests.shrunk import SHRUNK


def pretrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """launch/pretrain.py in a fork of the test process (tests/cli.py); test_short_run_writes_metrics starts a
    real interpreter."""
    return run_script("launch/pretrain.py", *args, timeout=timeout)


def test_short_run_writes_metrics(tmp_path):
    """The README's quick start, shortened: metrics, and the checkpoint of the last step, which it names."""
    out = subprocess.run(
        [
            sys.executable,
            "launch/pretrain.py",
            "--config",
            "configs/tiny.yaml",
            "--train.steps",
            "3",
            "--train.out_dir",
            str(tmp_path),
            "--checkpoint.dir",
            str(tmp_path / "checkpoints"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "ETA" in out.stdout
    assert f"checkpoint: saved {tmp_path / 'checkpoints' / 'step_000003'}\n" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003\n"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--parallel.tp", "3"], "parallel.tp=3 must divide model.num_heads=8"),
        (["--parallel.tp", "2"], "tp(2) * pp(1) * cp(1) * dp(auto) != world size(1)"),
        (["--train.stepz", "3"], "unknown config key 'train.stepz'"),
        (["--config", "configs/missing.yaml"], "config file 'configs/missing.yaml' does not exist"),
        (["--data.paths", "[/nonexistent/corpus.txt]"], "/nonexistent/corpus.txt"),
        (
            [
                "--parallel.dp_mode",
                "zero",
                "--parallel.zero_stage",
                "1",
                "--parallel.ds_config",
                "/nonexistent/ds.json",
            ],
            "parallel.ds_config '/nonexistent/ds.json' is not a file",
        ),
        # a key only another dp mode reads: tests/config/test_config.py (in process, each mode's words)
        # fsdp's gradient accumulation (issue 46): its values
        (
            ["--parallel.dp_mode", "fsdp", "--parallel.fsdp_grad_accumulation", "full"],
            "parallel.fsdp_grad_accumulation='full' is not one of sharded, unsharded",
        ),
        (["--parallel.bucket_mb", "0"], "parallel.bucket_mb=0"),
        (["--parallel.grad_compression", "powersgd", "--parallel.powersgd_rank", "0"], "parallel.powersgd_rank=0"),
        (
            ["--parallel.grad_compression", "powersgd", "--parallel.powersgd_warmup_steps", "1"],
            "parallel.powersgd_warmup_steps=1 must be >= 2",
        ),
        (
            ["--parallel.grad_compression", "bf16", "--parallel.schedule", "zero_bubble"],
            "parallel.grad_compression=bf16 is not supported with parallel.schedule=zero_bubble",
        ),
        (["--parallel.virtual_stages", "2"], "parallel.virtual_stages=2 needs parallel.schedule=interleaved"),
        # issue 42: accepted, then a traceback (the first optimizer step's fp32 overflow, numpy's and torch's seeding,
        # torch's normal_; an integer past Python's digit limit in the YAML reader)
        (["--train.lr", "1e39"], "train.lr=1e+39 must be in [0, 1]: Adam moves every weight by about lr per step"),
        (["--train.seed", "-1"], "train.seed=-1 must be in [0, 4294967295]"),
        (["--train.seed", "1e20"], "train.seed=100000000000000000000 must be in [0, 4294967295]"),
        (["--model.init_std", "-0.02"], "model.init_std=-0.02 must be >= 0"),
        (["--train.steps", "9" * 5000], "' is not an integer"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, args, needle):
    out = pretrain("--config", "configs/tiny.yaml", "--train.out_dir", str(tmp_path), *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert needle in lines[0]
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.slow  # ~30 s on a loaded 2-core machine: DeepSpeed's import and its first step
def test_plain_python_runs_dp_mode_zero(tmp_path):
    pytest.importorskip("deepspeed")
    # No launcher, so no LOCAL_RANK, which deepspeed.initialize asserts on.
    out = pretrain(
        "--config",
        "configs/tiny.yaml",
        *SHRUNK,
        "--train.steps",
        "2",
        "--parallel.dp_mode",
        "zero",
        "--parallel.zero_stage",
        "1",
        "--train.out_dir",
        str(tmp_path),
        "--log.progress",
        "false",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
