"""DeepSpeed's tunable settings (engine/kinds/ds_config.py): the defaults ship in the package, not in the
repository's configs/ (what a non-editable ``pip install .`` lacks); parallel.ds_config merges over them; a bad
file is one ConfigError line at load time. No DeepSpeed needed: ds_config() only builds the dict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from engine.config import ConfigError, load
from engine.parallel.dp.zero import ds_config
from tests.cli import ROOT, run_script

ZERO2 = ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "2"]


class Ctx:
    dp = 2


def test_defaults_are_found_in_a_copy_of_the_package_without_the_repository(tmp_path):
    # Only engine/ is copied (as pip installs it); run from there so neither the checkout nor its configs/ is seen.
    shutil.copytree(ROOT / "engine", tmp_path / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import json, engine; from engine.config import load; from engine.parallel.dp.zero import ds_config\n"
        "class Ctx: dp = 1\n"
        "print(engine.__file__); print(json.dumps({s: ds_config(load(['--parallel.dp_mode', 'zero', "
        "'--parallel.zero_stage', str(s)]), Ctx())['zero_optimization'] for s in (1, 2, 3)}))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    where, got = out.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(tmp_path)), where
    zero = {int(k): v for k, v in json.loads(got).items()}
    assert [zero[s]["stage"] for s in (1, 2, 3)] == [1, 2, 3]
    assert all(zero[s]["reduce_bucket_size"] == 50_000_000 and zero[s]["overlap_comm"] is False for s in (1, 2, 3))
    assert zero[3]["stage3_param_persistence_threshold"] == 100_000 and zero[2]["reduce_scatter"] is True


def test_user_file_is_merged_key_by_key_and_our_keys_are_filled_in(tmp_path):
    path = tmp_path / "ds.json"
    # fp16 disabled is no conflict with train.dtype: accepted, where fp16 enabled is refused (below)
    content = {"zero_optimization": {"overlap_comm": True}, "wall_clock_breakdown": True, "fp16": {"enabled": False}}
    path.write_text(json.dumps(content))
    c = ds_config(load([*ZERO2, "--parallel.ds_config", str(path)]), Ctx())
    z = c["zero_optimization"]
    assert z["overlap_comm"] is True and z["reduce_bucket_size"] == 50_000_000 and z["stage"] == 2
    assert c["wall_clock_breakdown"] is True and c["train_batch_size"] == 16
    assert ds_config(load(ZERO2), Ctx())["zero_optimization"]["overlap_comm"] is False  # defaults untouched
    # a count of 0 is a count (ZeRO-3 keeps no parameter whole): accepted, not refused as below 0 (issue 45)
    path.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    zero3 = ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "3", "--parallel.ds_config", str(path)]
    assert ds_config(load(zero3), Ctx())["zero_optimization"]["stage3_param_persistence_threshold"] == 0


@pytest.mark.parametrize(
    "content,words",
    [
        (None, "is not a file"),
        ("{not json", r"is not valid JSON \(line 1"),
        ("[1, 2]", "holds a JSON list"),
        ('{"optimizer": {"type": "Adam"}}', "sets 'optimizer'; remove it"),
        ('{"scheduler": {}}', "sets 'scheduler'; remove it"),
        ('{"fp16": {"enabled": true}}', "enables fp16; use train.dtype=bf16"),
        ('{"train_batch_size": 8}', "from train.global_batch_size"),
        ('{"zero_optimization": {"stage": 3}}', "from parallel.zero_stage"),
    ],
)
def test_bad_user_file_is_one_line_at_load(tmp_path, content, words):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=words) as e:
        load([*ZERO2, "--parallel.ds_config", str(path)])
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_ds_config_without_dp_mode_zero_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{}")
    with pytest.raises(ConfigError, match="read only with parallel.dp_mode=zero"):
        load(["--parallel.ds_config", str(path)])


@pytest.mark.parametrize(
    "stage,value,words",
    [
        (1, "true", "allows only when it partitions gradients (zero_stage 2 or 3; got parallel.zero_stage=1)"),
        (2, '"yes"', "it must be true or false"),
        (1, "false", None),
        (2, "true", None),
        (3, "true", None),
    ],
)
def test_overlap_comm_is_refused_at_zero_1_in_one_line(tmp_path, stage, value, words):
    """DeepSpeed asserts overlap_comm only with partitioned gradients when the engine owns the accumulation
    boundary (managed_gradient_accumulation false): before, ZeRO-1 with it was a traceback on every rank."""
    path = tmp_path / "ds.json"
    path.write_text(f'{{"zero_optimization": {{"overlap_comm": {value}}}}}')
    argv = ["--parallel.dp_mode", "zero", "--parallel.zero_stage", str(stage), "--parallel.ds_config", str(path)]
    if words is None:
        assert ds_config(load(argv), Ctx())["zero_optimization"]["overlap_comm"] is json.loads(value)
        return
    with pytest.raises(ConfigError) as e:
        load(argv)
    assert words in str(e.value) and "'zero_optimization.overlap_comm'" in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_overlap_comm_at_zero_1_exits_2_with_one_line_from_the_launcher(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"overlap_comm": true}}')
    out = run_script(
        "launch/pretrain.py",
        "--config",
        "configs/tiny.yaml",
        "--parallel.dp_mode",
        "zero",
        "--parallel.zero_stage",
        "1",
        "--parallel.ds_config",
        path,
        "--train.out_dir",
        tmp_path / "run",
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "overlap_comm" in errors[0] and "Traceback" not in out.stderr, out.stderr[-3000:]


# Where the built-in defaults depart from DeepSpeed's own on purpose (engine/kinds/ds_config.py says why): smaller
# buckets, and no overlap of the gradient reduction with backward at ZeRO-3 (what the planner models).
DEPARTURES = {
    1: {"reduce_bucket_size", "allgather_bucket_size"},
    2: {"reduce_bucket_size", "allgather_bucket_size"},
    3: {"reduce_bucket_size", "overlap_comm"},
}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_defaults_are_deepspeeds_own_but_where_they_depart_on_purpose(stage):
    """The defaults pin DeepSpeed's tuning (so a DeepSpeed release that changes its own defaults changes no run of
    ours) to DeepSpeed's own values, read from DeepSpeed's config model as it parses what ds_config() hands it,
    except the departures above: a pinned value that differs from DeepSpeed's unnoticed (contiguous gradients off,
    ZeRO-3's live-parameter cap or reuse distance off by 10x, DeepSpeed's timers or 16-bit gathers on save turned on)
    fails here, as does DeepSpeed moving a default away from ours when it is upgraded."""
    from deepspeed.runtime.constants import WALL_CLOCK_BREAKDOWN_DEFAULT
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    c = ds_config(load(["--parallel.dp_mode", "zero", "--parallel.zero_stage", str(stage)]), Ctx())
    ours = DeepSpeedZeroConfig(**c["zero_optimization"]).model_dump()
    theirs = DeepSpeedZeroConfig(stage=stage).model_dump()
    assert {k for k in ours if ours[k] != theirs[k]} == DEPARTURES[stage], {
        k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]
    }
    assert c["wall_clock_breakdown"] is WALL_CLOCK_BREAKDOWN_DEFAULT
