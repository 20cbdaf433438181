"""Reading checkpoints back (issue 34, part D), where a user meets it: launch/pretrain.py and launch/convert.py export.

A checkpoint that cannot be read or parsed is treated as a corrupt one: ``resume: auto`` prints one line naming
the step and why and resumes the next older good step; an explicit ``checkpoint.resume PATH`` and ``convert.py
export`` print one ``error:`` line and exit 2. Each case damages the newest step (6) of a copy of one small MoE
run's checkpoints (steps 3 and 6):
- index.json valid JSON with bad inner fields: consumed_samples missing, parts 0, adam_step "abc"; rank 0's part
  of the index (issue 43) with bytes a string or a piece of 2 numbers (before: KeyError / TypeError / IndexError /
  ValueError tracebacks); the locator cut short;
- a part naming its shard ``../../elsewhere/...`` (before: read from outside the step directory);
- (issue 42) index.json with a step of 5000 digits, num_heads 0, num_heads 128 on hidden_size 64 (before: ValueError
  and ZeroDivisionError tracebacks, and no fall-back to step 3 under auto);
- a NaN router weight with a matching CRC (before: resumed without a word);
- ``latest`` holding a non-UTF-8 byte (before: UnicodeDecodeError); auto then tries the step directories and
  resumes step 6, which is good;
- (a real process without CAP_DAC_OVERRIDE) a shard and ``latest`` of mode 000 (before: PermissionError).
Step 6 rewritten in version 1 (one index.json, as before issue 43) resumes and exports as step 6 does.
The launchers run in-process as ``__main__`` (their own exit-code and one-line handling; os._exit raised as
SystemExit) in one forked process, so each case costs a model build, not an interpreter start.
A dense resume inside warmup (step 3 of train.warmup_steps 8) equals the uninterrupted run (losses and grad norms,
same layout: bit-identical in practice, rel <= 1e-6); the other dense resume tests all resume after warmup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.choose import read_latest, resolve
from engine.checkpoint.format import CheckpointError, file_crc32
from tests.checkpoint.runs import SAME, SMALL, assert_curves, edit_index, launched
from tests.checkpoint.versions import as_version_1
from tests.cli import ROOT, run_script, without_file_permission_override
from tests.dist import run_ranks

MOE = [*SMALL, "--model.family", "mixtral", "--model.num_experts", "4", "--model.experts_per_token", "2"]
ROUTER = "model.layers.0.block_sparse_moe.gate.weight"  # Mixtral's name for the router
SHARD, PART = "rank_00000.safetensors", "part_00000.json"


def edit_part(step: Path, change) -> None:
    """Change rank 0's part of the index (its pieces, shard size and CRC: engine/checkpoint/format.py)."""
    edit_index(step, change, PART)


def first_piece(index: dict) -> list:
    return next(iter(index["params"].values()))["states"]["param"][0]


def outside(step: Path) -> None:
    """The shard moved to ckpt/../elsewhere and the index part naming it there: size and CRC still match."""
    elsewhere = step.parent.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    shutil.copyfile(step / SHARD, elsewhere / SHARD)
    text = (step / PART).read_text().replace(f'"{SHARD}"', f'"../../elsewhere/{SHARD}"')
    (step / PART).write_text(text)


def nan_router(step: Path) -> None:
    """A NaN in the router's weight, with the part's byte count and CRC made to match: only a finiteness
    check can tell."""
    tensors = load_file(str(step / SHARD))
    key = next(k for k in tensors if k.startswith(f"{ROUTER}/param/"))
    tensors[key][0] = float("nan")
    save_file(tensors, str(step / SHARD), metadata={"format": "pt"})
    edit_part(step, lambda p: p.update(bytes=(step / SHARD).stat().st_size, crc32=file_crc32(step / SHARD)))


def long_step(step: Path) -> None:
    """A step of 5000 digits: past Python's int digit limit, json.loads raised ValueError (a traceback)."""
    edit_index(step, lambda i: i.update(step=-123456789))
    text = (step / "index.json").read_text().replace("-123456789", "9" * 5000)
    (step / "index.json").write_text(text)


# name -> (what it does to step 6, words of the one line that must name it)
DAMAGES = {
    "part's bytes a string": (
        lambda s: edit_part(s, lambda p: p.update(bytes="5")),
        f"{PART}: bytes is '5', not an integer",
    ),
    "consumed_samples missing": (
        lambda s: edit_index(s, lambda i: i.pop("consumed_samples")),
        "consumed_samples is missing",
    ),
    "parts 0": (lambda s: edit_index(s, lambda i: i.update(parts=0)), "parts is 0, not an integer >= 1"),
    "adam_step abc": (lambda s: edit_index(s, lambda i: i.update(adam_step="abc")), "adam_step is 'abc'"),
    "piece of 2 numbers": (
        lambda s: edit_part(s, lambda p: first_piece(p).pop()),
        "['param'][0] is [0, 0], not a piece",
    ),
    "locator cut short": (
        lambda s: (s / "locator.jsonl").write_text((s / "locator.jsonl").read_text()[:-7]),
        "locator.jsonl has",
    ),
    "shard outside the step dir": (outside, "outside the checkpoint directory"),
    # issue 42: tracebacks (ValueError, ZeroDivisionError building the model), and no fall-back under auto
    "step of 5000 digits": (long_step, "index.json holds an integer of 5000 digits at line 1"),
    "num_heads 0": (
        lambda s: edit_index(s, lambda i: i["config"]["model"].update(num_heads=0)),
        "config.model.num_heads is 0, not an integer >= 1",
    ),
    "num_heads above hidden_size": (
        lambda s: edit_index(s, lambda i: i["config"]["model"].update(num_heads=128)),
        "config.model: model.hidden_size=64 is not divisible by model.num_heads=128",
    ),
    "NaN router weight": (nan_router, f"NaN/inf values in {ROUTER} (param) of step 6"),
}


def cases_rank(base: Path, tmp: Path) -> dict:
    """Rank function (one process, as a plain ``python launch/...``): every damage x {auto, explicit, export}."""
    import torch.distributed as dist

    dist.destroy_process_group()  # run_ranks' group: each launch makes and destroys its own, in memory
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    train = launched(
        "launch/pretrain.py",
        [
            *MOE,
            "--train.steps",
            "6",
            "--checkpoint.every",
            "3",
            "--checkpoint.keep",
            "0",
            "--checkpoint.dir",
            str(base),
            "--train.out_dir",
            str(tmp / "base_out"),
        ],
    )
    got = {"base": train}
    for name, (damage, _) in {**DAMAGES, "latest not UTF-8": (None, "")}.items():
        ckpt = tmp / name.replace(" ", "_") / "ckpt"
        shutil.copytree(base, ckpt)
        if damage is None:
            (ckpt / "latest").write_bytes(b"step_00\xff0006\n")
            target = ckpt  # followed through latest
        else:
            damage(ckpt / "step_000006")
            target = ckpt / "step_000006"
        run = [*MOE, "--train.steps", "3", "--train.out_dir", str(ckpt.parent / "out")]  # resumed: nothing to do
        got[name] = {
            "explicit": launched("launch/pretrain.py", [*run, "--checkpoint.resume", str(target)]),
            "export": launched("launch/convert.py", ["export", str(target), str(ckpt.parent / "hf")]),
            # last: it sets the damaged step 6 aside (engine/checkpoint/lineage.py)
            "auto": launched("launch/pretrain.py", [*run, "--checkpoint.dir", str(ckpt)]),
        }
    bare = tmp / "no_latest" / "ckpt"  # a crash between a first save's rename and its latest; a copied folder
    shutil.copytree(base, bare)
    (bare / "latest").unlink()
    got["no latest"] = launched(
        "launch/pretrain.py",
        [*MOE, "--train.steps", "3", "--train.out_dir", str(bare.parent / "out"), "--checkpoint.dir", str(bare)],
    )
    old = tmp / "version_1" / "ckpt"
    shutil.copytree(base, old)
    as_version_1(old / "step_000006")
    for name, ckpt in (("version 1", old), ("version 2", base)):
        out = tmp / name.replace(" ", "_")
        got[name] = {
            "resume": launched(
                "launch/pretrain.py",
                [*MOE, "--train.steps", "8", "--train.out_dir", str(out / "out"), "--checkpoint.resume", str(ckpt)],
            ),
            "export": launched("launch/convert.py", ["export", str(ckpt / "step_000006"), str(out / "hf")]),
        }
    return got


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("read")
    return tmp, run_ranks(cases_rank, 1, tmp / "base", tmp, timeout_s=1200)[0]


def one_error_line(run: dict, words: str) -> str:
    assert run["code"] == 2, f"exit {run['code']}, not 2:\n{run['err'][-3000:]}"
    lines = run["err"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], run["err"][-3000:]
    return lines[0]


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_newest_step_is_skipped_by_auto_and_refused_when_named(cases, name):
    tmp, got = cases
    assert got["base"]["code"] == 0, got["base"]["err"][-3000:]
    ckpt, words = tmp / name.replace(" ", "_") / "ckpt", DAMAGES[name][1]
    auto = got[name]["auto"]
    assert auto["code"] == 0, f"exit {auto['code']}:\n{auto['err'][-3000:]}"
    skipped = [line for line in auto["out"].splitlines() if line.startswith("checkpoint: skipping")]
    assert len(skipped) == 1 and str(ckpt / "step_000006") in skipped[0] and words in skipped[0], auto["out"]
    assert f"resumed from {ckpt / 'step_000003'} (step 3" in auto["out"], auto["out"][-3000:]
    assert "Traceback" not in auto["err"], auto["err"][-3000:]
    one_error_line(got[name]["explicit"], words)
    one_error_line(got[name]["export"], words)
    assert not (ckpt.parent / "hf").exists(), "a refused export left its folder"


def test_a_latest_that_is_not_text_is_ignored_by_auto_and_refused_when_followed(cases):
    tmp, got = cases
    ckpt, run = tmp / "latest_not_UTF-8" / "ckpt", got["latest not UTF-8"]
    assert run["auto"]["code"] == 0, run["auto"]["err"][-3000:]
    assert f"checkpoint: ignoring {ckpt / 'latest'}: {ckpt / 'latest'} is not text" in run["auto"]["out"]
    assert f"resumed from {ckpt / 'step_000006'} (step 6" in run["auto"]["out"], run["auto"]["out"][-3000:]
    one_error_line(run["explicit"], "is not text")
    one_error_line(run["export"], "is not text")


def test_auto_without_latest_resumes_the_newest_step(cases):
    """resume: auto in a folder of step directories with no latest resumes the newest, as latest would have
    (issue 45: a mutant that made it start over survived)."""
    tmp, got = cases
    run = got["no latest"]
    assert run["code"] == 0, run["err"][-3000:]
    assert f"resumed from {tmp / 'no_latest' / 'ckpt' / 'step_000006'} (step 6" in run["out"], run["out"][-3000:]


def test_a_version_1_checkpoint_resumes_and_exports_as_its_version_2_twin(cases):
    """Step 6 rewritten in the format before issue 43 (one index.json with every rank's pieces) resumes through
    launch/pretrain.py to the same losses, and exports to the same bytes, as the step it was made from."""
    tmp, got = cases
    old, new = got["version 1"], got["version 2"]
    for run in (old["resume"], old["export"], new["resume"], new["export"]):
        assert run["code"] == 0, run["err"][-3000:]
    assert not (tmp / "version_1" / "ckpt" / "step_000006" / "locator.jsonl").exists()
    assert f"resumed from {tmp / 'version_1' / 'ckpt' / 'step_000006'} (step 6" in old["resume"]["out"]
    losses = [
        [r["loss"] for r in metrics(tmp / name / "out").values() if "loss" in r] for name in ("version_1", "version_2")
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
    exported = [tmp / name / "hf" / "model.safetensors" for name in ("version_1", "version_2")]
    assert exported[0].read_bytes() == exported[1].read_bytes()


def test_unreadable_shard_and_latest_fall_back_and_are_refused_when_named(cases):
    tmp, _ = cases
    prefix = without_file_permission_override()
    ckpt = tmp / "unreadable" / "ckpt"
    shutil.copytree(tmp / "base", ckpt)
    shard = ckpt / "step_000006" / SHARD
    shard.chmod(0)
    (ckpt / "latest").chmod(0)
    run = [*MOE, "--train.steps", "3", "--train.out_dir", str(ckpt.parent / "out")]

    def launch(*args: str) -> dict:
        p = subprocess.run([*prefix, sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
        return {"code": p.returncode, "out": p.stdout, "err": p.stderr}

    auto = launch("launch/pretrain.py", *run, "--checkpoint.dir", str(ckpt))
    assert auto["code"] == 0, auto["err"][-3000:]
    assert f"checkpoint: ignoring {ckpt / 'latest'}: cannot read" in auto["out"], auto["out"][-3000:]
    assert (
        f"checkpoint: skipping {ckpt / 'step_000006'}: shard {shard} cannot be read (Permission denied)" in auto["out"]
    ), auto["out"][-3000:]
    assert f"resumed from {ckpt / 'step_000003'}" in auto["out"], auto["out"][-3000:]
    aside = ckpt / "set_aside"  # the unreadable step lay above the start: moved aside, not deleted
    shard = next(aside.iterdir()) / SHARD
    one_error_line(launch("launch/pretrain.py", *run, "--checkpoint.resume", str(shard.parent)), "Permission denied")
    one_error_line(
        launch("launch/convert.py", "export", str(shard.parent), str(tmp / "unreadable" / "hf")), "Permission denied"
    )
    restored = tmp / "unreadable" / "with_latest"
    restored.mkdir()
    shutil.copyfile(ckpt / "latest", restored / "latest")
    (restored / "latest").chmod(0)
    one_error_line(launch("launch/convert.py", "export", str(restored), str(tmp / "unreadable" / "hf")), "cannot read")


def metrics(out_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_dense_resume_inside_warmup_equals_the_uninterrupted_run(tmp_path):
    warm = [
        *SMALL,
        "--train.steps",
        "6",
        "--train.warmup_steps",
        "8",
        "--checkpoint.every",
        "3",
        "--checkpoint.keep",
        "0",
        "--checkpoint.dir",
        str(tmp_path / "ckpt"),
    ]
    straight = run_script(
        "launch/pretrain.py",
        *warm,
        "--checkpoint.resume",
        "none",
        "--train.out_dir",
        tmp_path / "straight",
        timeout=600,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    resumed = run_script(
        "launch/pretrain.py",
        *warm,
        "--checkpoint.dir",
        tmp_path / "c2",
        "--checkpoint.resume",
        tmp_path / "ckpt" / "step_000003",
        "--train.out_dir",
        tmp_path / "resumed",
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert sorted(got) == [4, 5, 6], sorted(got)
    for key in ("loss", "grad_norm"):
        assert_curves(
            [got[s][key] for s in (4, 5, 6)],
            [want[s][key] for s in (4, 5, 6)],
            SAME,
            f"{key} resumed at step 3 of 8 warmup steps vs uninterrupted",
        )
    assert all(torch.isfinite(torch.tensor(want[s]["grad_norm"])) for s in want)


def test_a_path_or_latest_that_cannot_be_read_is_named_with_the_reason_only(tmp_path):
    """resolve() and read_latest() in-process: a path the system will not look up (a name over 255 bytes) and a
    ``latest`` that is a folder say why in the system's words ('File name too long', 'Is a directory'), not the
    exception's repr with the path a second time; a ``latest`` holding garbage is quoted to its first 40
    characters."""
    long = tmp_path / ("x" * 300)
    with pytest.raises(CheckpointError) as refused:
        resolve(long)
    assert str(refused.value) == f"checkpoint path '{long}' cannot be read (File name too long)"
    (tmp_path / "run" / "latest").mkdir(parents=True)
    assert read_latest(tmp_path / "run") == (None, f"cannot read {tmp_path / 'run' / 'latest'} (Is a directory)")
    (tmp_path / "run" / "latest").rmdir()
    (tmp_path / "run" / "latest").write_text("0123456789" * 6)
    why = read_latest(tmp_path / "run")[1]
    assert why == f"{tmp_path / 'run' / 'latest'} holds {'0123456789' * 4!r}, not the name of a step_* directory", why
