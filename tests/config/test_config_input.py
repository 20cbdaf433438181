"""Malformed parallel.ds_config files and YAML configs through launch/pretrain.py, as a user meets them (issue 34,
part B): one ``error:`` line naming the key, exit 2, at config load (before any model is built).

Before: a DeepSpeed file nested 200,000 deep was a RecursionError traceback; NaN, Infinity or a string for a bucket
size passed the config checks and failed in DeepSpeed's own validation on every rank after the model was built; a
key given twice kept the last silently. A YAML alias bomb (nine lines) gave a 39 MB error line, and any long value
quoted in an error gave a line as long as it (engine/config_yaml.py, engine/errors.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import MAX_LINE
from tests.checkpoint.runs import SMALL
from tests.cli import ROOT, launch, one_error_line, run_script, without_file_permission_override
from tests.shrunk import SHRUNK

ZERO2 = ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "2", "--train.steps", "1"]
DS_CASES = {
    "nested-200000": ('{"a": ' * 200_000 + "1" + "}" * 200_000, "nests objects or lists too deep to read"),
    "nested-40": ('{"zero_optimization": ' + '{"a": ' * 40 + "1" + "}" * 41, "nests objects or lists 41 levels deep"),
    "nan": (
        '{"zero_optimization": {"reduce_bucket_size": NaN}}',
        "sets 'zero_optimization.reduce_bucket_size'=NaN; it must be a finite number",
    ),
    "infinity": (
        '{"zero_optimization": {"allgather_bucket_size": Infinity}}',
        "sets 'zero_optimization.allgather_bucket_size'=Infinity; it must be a finite number",
    ),
    "string": (
        '{"zero_optimization": {"reduce_bucket_size": "lots"}}',
        "sets 'zero_optimization.reduce_bucket_size'=\"lots\"; it must be a whole number >= 0",
    ),
    # a count below 0 (issue 45: the bound was not checked); the example is the built-in default (README: 5e7)
    "negative": (
        '{"zero_optimization": {"reduce_bucket_size": -1}}',
        "sets 'zero_optimization.reduce_bucket_size'=-1; it must be a whole number >= 0 (such as 50000000)",
    ),
    "flag-number": (
        '{"zero_optimization": {"contiguous_gradients": 1}}',
        "sets 'zero_optimization.contiguous_gradients'=1; it must be true or false",
    ),
    "key-twice": (
        '{"zero_optimization": {"reduce_bucket_size": 5000, "reduce_bucket_size": 6000}}',
        "gives the key 'reduce_bucket_size' twice in one object",
    ),
}


@pytest.mark.parametrize("case", list(DS_CASES))
def test_a_malformed_ds_config_is_one_line_at_load(tmp_path, case):
    text, words = DS_CASES[case]
    path = tmp_path / "ds.json"
    path.write_text(text)
    out = launch("pretrain.py", *SMALL, *ZERO2, "--parallel.ds_config", path, "--train.out_dir", tmp_path / "o")
    one_error_line(out, f"parallel.ds_config '{path}'", words)
    assert "layout tp=" not in out.stdout  # refused at load, before the trainer was built


def test_an_unreadable_ds_config_is_one_line_at_load(tmp_path):
    """A ds_config file that exists but cannot be read (mode 000; for root, without the capabilities that read
    anyway): one line naming it and why (issue 45: no test reached the OSError, so a traceback would pass)."""
    prefix = without_file_permission_override()
    path = tmp_path / "ds.json"
    path.write_text("{}")
    path.chmod(0)
    argv = [*SMALL, *ZERO2, "--parallel.ds_config", str(path), "--train.out_dir", str(tmp_path / "o")]
    out = subprocess.run(
        [*prefix, sys.executable, "launch/pretrain.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    one_error_line(out, f"parallel.ds_config '{path}' cannot be read", "Permission denied")


def bomb(levels: int = 7) -> str:
    """Nested aliases: ``levels`` lines standing for 9**levels values."""
    parts = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def test_a_yaml_alias_bomb_is_one_short_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"model:\n  name: {bomb()}\n")
    line = one_error_line(
        launch("pretrain.py", "--config", path),
        f"config file '{path}': the document expands to more than 100000 values through its aliases",
    )
    assert len(line) < 300, line[:400]
    line = one_error_line(
        launch("pretrain.py", "--model.name", bomb()), "--model.name: the document expands to more than 100000 values"
    )
    assert len(line) < 300, line[:400]


def test_a_recursive_alias_is_one_line(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("model:\n  name: &a [*a]\n")
    one_error_line(launch("pretrain.py", "--config", path), "contains itself through an alias")


def test_a_long_value_in_an_error_is_cut_to_a_sane_line(tmp_path):
    """No alias: 20000 plain values (under the expansion bound) quoted by the type check."""
    path = tmp_path / "long.yaml"
    path.write_text("model:\n  name: [" + ", ".join(["lol"] * 20_000) + "]\n")
    line = one_error_line(
        launch("pretrain.py", "--config", path), "error: model.name=['lol'", "characters cut]", "is not a string"
    )
    assert len(line) <= MAX_LINE + len("error: "), len(line)


def test_a_config_of_thousands_of_paths_still_loads(tmp_path):
    from engine.config import load_yaml

    paths = [str(Path("/data") / f"shard_{i:05d}.bin") for i in range(20_000)]
    path = tmp_path / "many.yaml"
    path.write_text("data:\n  paths: [" + ", ".join(paths) + "]\n")
    assert load_yaml(path).data.paths == paths


@pytest.mark.parametrize("given", ["cli", "file"])
def test_a_path_is_the_text_written_not_what_yaml_types_it_as(tmp_path, given):
    """Issue 42 item 9: ``out_dir 0700`` wrote into ``448/`` (YAML 1.1 octal) and ``checkpoint.dir on`` into
    ``true/``, from the command line and from a config file alike; a string field takes the text written."""
    tiny = (ROOT / "configs" / "tiny.yaml").read_text()
    if given == "cli":
        config, extra = ROOT / "configs" / "tiny.yaml", ["--train.out_dir", "0700", "--checkpoint.dir", "on"]
    else:
        config, extra = tmp_path / "run.yaml", []
        config.write_text(tiny.replace("out_dir: runs/tiny", "out_dir: 0700") + "checkpoint:\n  dir: on\n")
    run = tmp_path / "run"
    run.mkdir()
    args = ["--config", config, *SHRUNK, "--train.steps", "1", "--log.progress", "false", *extra]
    out = run_script(str(ROOT / "launch" / "pretrain.py"), *args, cwd=run, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir()) == ["0700", "on"]
    assert (run / "0700" / "metrics.jsonl").is_file() and (run / "on" / "step_000001" / "index.json").is_file()


@pytest.mark.parametrize("given", ["cli", "file"])
def test_two_configs_loaded_from_one_text_share_no_list(tmp_path, given):
    """engine/config.py keeps the parse of the last YAML texts (the parity checks load ~35,000 configs), and no
    piece of it may reach a Config (coerce builds each list anew): changing one Config's list (parallel.pp_layers)
    leaves the next one read from the same text as written. Fails with coerce passing a list through."""
    from engine.config import load

    path = tmp_path / "run.yaml"
    path.write_text("parallel:\n  pp: 2\n  pp_layers: [1, 1]\n" if given == "file" else "parallel:\n  pp: 2\n")
    argv = ["--config", str(path)] + (["--parallel.pp_layers", "[1, 1]"] if given == "cli" else [])
    first = load(argv)
    first.parallel.pp_layers.append(5)
    assert load(argv).parallel.pp_layers == [1, 1]
