"""A non-editable install is the whole engine: every subpackage and data file ships, and an installed copy trains
with dp_mode zero from outside the checkout (its tokenizer, corpus and DeepSpeed defaults from site-packages)."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_engine_folder_and_data_file_is_packaged():
    found = set(find_packages(str(ROOT), include=SETUPTOOLS["packages"]["find"]["include"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "engine").rglob("*.py")}
    # engine/assets/make_tokenizer.py is a repository tool (it rewrote the committed tokenizer files); the install
    # needs only its outputs, which ship as package data below.
    assert folders - found - {"engine.assets"} == set(), (
        "folders with Python files that a wheel would leave out (no __init__.py?)"
    )
    globs = SETUPTOOLS["package-data"]["engine"]
    data = [
        p.relative_to(ROOT / "engine").as_posix()
        for p in (ROOT / "engine").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert data, "engine/ has no data files: the bundled tokenizer and corpus are missing"
    assert [f for f in data if not any(fnmatch.fnmatch(f, g) for g in globs)] == [], (
        "data files under engine/ that package-data leaves out"
    )


TRAIN = """
import json, math, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import engine, engine.data.dataset
from engine.config import load
from engine.parallel.layout.context import ParallelContext, destroy
from engine.trainer import Trainer
cfg = load(["--config", sys.argv[2], "--train.steps", "2", "--train.out_dir", "out", "--train.eval_every", "0",
            "--parallel.dp_mode", "zero", "--parallel.zero_stage", "1"])
ctx = ParallelContext.from_config(cfg)
trainer = Trainer(cfg, ctx)
losses = [r["loss"] for r in trainer.fit()]
print("RESULT", json.dumps({"engine": engine.__file__, "assets": str(engine.data.dataset.ASSETS),
                            "mode": type(trainer.dp).__module__, "losses": losses}), flush=True)
destroy()
os._exit(0)
"""


@pytest.mark.slow
def test_installed_copy_trains_with_zero_outside_the_checkout(tmp_path):
    pytest.importorskip("deepspeed")
    # Build from a copy of what a source checkout holds (a stale build/ in the checkout could hide a missing file).
    src = tmp_path / "src"
    shutil.copytree(ROOT / "engine", src / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # The venv reuses this interpreter's packages (no network) and its setuptools; pip comes from there too.
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False)
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
        check=True,
        cwd=tmp_path,
        timeout=600,
    )
    shutil.rmtree(src)  # nothing may be read from the copy it was built from
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "configs" / "tiny.yaml", run / "tiny.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [python, "-c", TRAIN, str(29500 + os.getpid() % 2000), "tiny.yaml"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT ") :])
    site = str(tmp_path / "venv" / "lib")
    assert result["engine"].startswith(site) and result["assets"].startswith(site), result
    assert result["mode"] == "engine.parallel.dp.zero"
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"]), result
