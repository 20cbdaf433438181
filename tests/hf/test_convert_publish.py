"""launch/convert.py and --model.init_from (issue 23, items 2 and 3): folders published whole, one-line refusals.

- A second export into the folder of a first one is refused (exit 2, the folder untouched); with --overwrite it
  replaces the folder whole: exactly the files of a fresh export, and init_from reads step 6's weights (before:
  step 6's model.safetensors beside step 3's index and shards, and init_from trained from step 3).
- init_from (and convert import) of a folder with a missing or truncated shard: one line, exit 2, the same check.
- An export target that cannot be written: one line, exit 2 (before: a SafetensorError traceback).
- A second import into the folder of a first one: refused unless --overwrite; a folder no import wrote: refused
  even with --overwrite (tests/checkpoint/test_overwrite.py has the rest of what --overwrite never replaces).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint.folder import MARKER
from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.checkpoint.runs import SMALL, files, read_only, train_six_steps
from tests.cli import ROOT, launch, one_error_line
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return train_six_steps(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def sharded(ckpt, tmp_path_factory) -> Path:
    """Step 3 exported in several files (model.safetensors.index.json + model-0000i-of-0000n.safetensors)."""
    out = tmp_path_factory.mktemp("sharded") / "hf"
    assert launch("convert.py", "export", ckpt / "step_000003", out, "--max-shard-size", "100KB").returncode == 0
    assert (out / "model.safetensors.index.json").is_file()
    return out


def weights(argv: list[str]) -> dict[str, torch.Tensor]:
    """Rank function (one rank): the parameters of a Trainer built from ``argv``."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_export_over_an_export_is_refused_and_overwrite_replaces_it_whole(ckpt, sharded, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(sharded, out)
    before = files(out)
    one_error_line(launch("convert.py", "export", ckpt / "step_000006", out), str(out), "not empty", "--overwrite")
    assert files(out) == before, "the refused export changed the folder"
    assert launch("convert.py", "export", ckpt / "step_000006", tmp_path / "fresh").returncode == 0
    over = launch("convert.py", "export", ckpt / "step_000006", out, "--overwrite")
    assert over.returncode == 0, over.stderr[-3000:]
    assert files(out) == files(tmp_path / "fresh"), "--overwrite left files of the first export"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary folder was left"
    common = [*SMALL, "--train.out_dir", str(tmp_path / "o")]
    init, step6, step3 = (
        run_ranks(weights, 1, argv)[0]
        for argv in (
            [*common, "--model.init_from", str(out)],
            [*common, "--checkpoint.resume", str(ckpt / "step_000006")],
            [*common, "--checkpoint.resume", str(ckpt / "step_000003")],
        )
    )
    assert any(not torch.equal(step6[n], step3[n]) for n in step6), "steps 3 and 6 should differ"
    for name, tensor in step6.items():  # fp32 export: exact
        assert torch.equal(init[name], tensor), f"init_from's {name} is not step 6's"


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_init_from_and_import_of_a_damaged_shard_are_one_line(sharded, tmp_path, damage):
    hf = tmp_path / "hf"
    shutil.copytree(sharded, hf)
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    if damage == "missing":
        shard.unlink()
    else:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    want = (str(shard), "missing" if damage == "missing" else "truncated")
    line = one_error_line(
        launch("pretrain.py", *SMALL, "--model.init_from", hf, "--train.out_dir", tmp_path / "o"), *want
    )
    assert line.startswith("error: model.init_from: "), line
    one_error_line(launch("convert.py", "import", hf, tmp_path / "imported"), *want)
    assert not [p.name for p in tmp_path.iterdir() if "imported" in p.name], "the failed import left a folder"


def test_export_into_an_unwritable_folder_is_one_line(ckpt, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    with read_only(out):
        one_error_line(launch("convert.py", "export", ckpt / "step_000006", out), str(out), "cannot be written")
    assert list(tmp_path.iterdir()) == [out] and not list(out.iterdir())


def test_import_over_an_import_needs_overwrite_and_an_unrelated_folder_is_never_replaced(sharded, tmp_path):
    root = tmp_path / "imported"
    root.mkdir()
    (root / "notes.txt").write_text("an earlier run's")
    for flag in ([], ["--overwrite"]):  # issue 34: --overwrite replaced this folder, notes and all
        one_error_line(launch("convert.py", "import", sharded, root, *flag), str(root), "notes.txt", "not written by")
    assert [p.name for p in root.iterdir()] == ["notes.txt"]
    again = tmp_path / "again"
    assert launch("convert.py", "import", sharded, again).returncode == 0
    one_error_line(launch("convert.py", "import", sharded, again), str(again), "not empty", "--overwrite")
    out = launch("convert.py", "import", sharded, again, "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in again.iterdir()) == sorted(
        [MARKER, "config.yaml", "hf_files", "latest", "step_000000"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "imported"], "a temporary folder was left"


def test_exported_files_share_one_mode_from_the_umask(tmp_path):
    """safetensors creates its file 0600: model.safetensors was unreadable to the group that could read the
    config.json beside it. Under umask 027 every exported file is 0640."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ROOT / "tests" / "fixtures" / "pre_fusion_checkpoint", ckpt)  # the fixture stays untouched
    out = subprocess.run(
        [sys.executable, "launch/convert.py", "export", str(ckpt), str(tmp_path / "hf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(0o027),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o640"}, modes
