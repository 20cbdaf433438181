"""Checkpointed runs shared by the checkpoint tests (and cp's and the converters'): the shrunk model (SMALL), the
tolerances of a resume at the same and at another layout, phases run in one set of forked ranks (run_phases), the
resume checks, a run saved at steps 3 and 6 (train_six_steps), a folder made unwritable (read_only), an index edited
in place (edit_index) and a launcher run in this process (launched)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist

from engine.checkpoint.checkpointer import CheckpointError
from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.cli import ROOT, launch
from tests.dist import run_ranks
from tests.numerics import rel_err
from tests.shrunk import SHRUNK

# tests/parallel/dp/test_zero.py's shrunk tiny model: a clip threshold below the gradient norm, so clipping is active.
SMALL = [
    "--config",
    "configs/tiny.yaml",
    *SHRUNK,
    "--train.steps",
    "20",
    "--train.warmup_steps",
    "3",
    "--train.grad_clip",
    "0.5",
    "--log.progress",
    "false",
]


DDP_DP2_PP2 = ["--parallel.pp", "2"]


TP2_PP2 = ["--parallel.tp", "2", "--parallel.pp", "2"]


# Evaluation right before a save leaves FSDP's root unsharded (forward only): the save must reshard it first.
FSDP_TP2 = ["--parallel.dp_mode", "fsdp", "--parallel.tp", "2", "--train.eval_every", "10"]


FSDP_PP2 = ["--parallel.dp_mode", "fsdp", "--parallel.pp", "2"]


TIED = ["--model.tie_embeddings", "true"]


SAME, MOVED = 1e-6, 1e-5  # tolerances: same layout, another layout


def zero(stage: int, *extra: str) -> list[str]:
    return ["--parallel.dp_mode", "zero", "--parallel.zero_stage", str(stage), *extra]


def straight(root: Path, *layout: str) -> tuple:
    """20 steps from scratch, checkpoints at steps 10 and 20 in ``root``."""
    return (
        "train",
        [
            *SMALL,
            *layout,
            "--checkpoint.dir",
            str(root),
            "--checkpoint.every",
            "10",
            "--checkpoint.resume",
            "none",
            "--train.out_dir",
            str(root / "out"),
        ],
    )


def resumed(path: Path, *layout: str) -> tuple:
    """Resume from ``path`` at ``layout`` and train to step 20 (without saving)."""
    return (
        "train",
        [*SMALL, *layout, "--checkpoint.resume", str(path), "--train.out_dir", str(path.parent / "resumed_out")],
    )


def run_phases(phases: list[tuple]) -> list:
    """Rank function. Phases: ("train", argv) -> {"start": step after resume, "loss": [...]};
    ("error", argv) -> the CheckpointError message; ("damage", [(op, path)]) -> rank 0 damages files;
    ("signal", (argv, rank, step)) -> train, and ``rank`` sends itself SIGTERM during step ``step``."""
    out = []
    for kind, arg in phases:
        if kind == "damage":
            if dist.get_rank() == 0:
                damage(arg)
            dist.barrier()
            out.append(None)
            continue
        argv, signal_rank, signal_step = arg if kind == "signal" else (arg, None, None)
        cfg = load(argv)
        try:
            trainer = Trainer(cfg, ParallelContext.from_config(cfg))
        except CheckpointError as e:
            assert kind == "error", f"unexpected {e}"
            out.append(str(e))
            continue
        assert kind != "error", "expected a CheckpointError"
        start = trainer.step
        if signal_rank == dist.get_rank():
            step = trainer.train_step

            def signalled(batch, step=step):
                if trainer.step == signal_step - 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # only this rank is signalled
                return step(batch)

            trainer.train_step = signalled
        out.append(
            {
                "start": start,
                "loss": [r["loss"] for r in trainer.fit()],
                "end": trainer.step,
                "skipped": trainer.checkpointer.skipped,
            }
        )
    return out


def damage(ops: list[tuple[str, Path]]) -> None:
    for op, path in ops:
        if op == "truncate":
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
        elif op == "remove":
            path.unlink()
        elif op == "flip":  # same size, different bytes: only the CRC can tell
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF
            path.write_bytes(bytes(data))
        elif op == "index":  # an index part whose pieces do not match the shards (one piece one element shorter)
            index = json.loads(path.read_text())
            next(iter(index["params"].values()))["states"]["param"][0][-1] -= 1
            path.write_text(json.dumps(index))
        elif op == "partial":  # a save cut short before its commit: a temporary directory with one shard
            path.mkdir(parents=True)
            (path / "rank_00000.safetensors").write_bytes(b"partial")


def assert_curves(got: list[float], want: list[float], rel: float, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} losses vs {len(want)}"
    worst = rel_err(got, want)
    assert worst <= rel, f"{what}: losses differ by rel {worst:.2e} > {rel}: {got} vs {want}"


def assert_follows(got: dict, want: list[float], rel: float, what: str) -> None:
    """``got`` resumed at step 10 and its losses equal steps 11..20 of ``want`` to ``rel``."""
    assert got["start"] == 10, f"{what}: resumed at step {got['start']}, not 10"
    assert_curves(got["loss"], want[10:], rel, what)


def check_resumes(tmp_path: Path, world: int, runs: dict) -> None:
    """``runs``: name -> (layout, [(label, layout to resume at, tolerance)]). Each named run trains 20 steps
    uninterrupted, then every resume of its step-10 checkpoint must follow it; the uninterrupted runs must also
    follow the first one of the same model (another layout: MOVED), so all are held to one loss curve."""
    phases, checks, first = [], [], {}
    for name, (layout, resumes) in runs.items():
        root = tmp_path / name.replace(" ", "_")
        reference = len(phases)
        model = tuple(a for a in layout if a.startswith("--model."))  # which model settings differ from SMALL
        if model in first:
            checks.append((f"uninterrupted {name} vs {first[model][0]}", reference, first[model][1], MOVED))
        first.setdefault(model, (name, reference))
        phases.append(straight(root, *layout))
        for label, other, tol in resumes:
            checks.append((f"{name} -> {label}", len(phases), reference, tol))
            phases.append(resumed(root / "step_000010", *other))
    results = run_ranks(run_phases, world, phases, timeout_s=600)[0]
    for label, got, want, tol in checks:
        if results[got]["start"] == 0:  # two uninterrupted runs: the whole curves
            assert_curves(results[got]["loss"], results[want]["loss"], tol, label)
        else:
            assert_follows(results[got], results[want]["loss"], tol, label)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def train_six_steps(root: Path) -> Path:
    """root/ckpt: checkpoints at steps 3 and 6 of SMALL's model (their weights differ); root/out: its out_dir."""
    out = launch(
        "pretrain.py",
        *SMALL,
        "--train.steps",
        "6",
        "--checkpoint.dir",
        root / "ckpt",
        "--checkpoint.every",
        "3",
        "--checkpoint.keep",
        "0",
        "--train.out_dir",
        root / "out",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "ckpt"


@contextlib.contextmanager
def read_only(folder: Path, moved_to: Path | None = None):
    """``folder`` made unwritable: mode 0555, or immutable (chattr +i) where the tests run as root; ``moved_to``:
    where the folder is when the block ends (the code under test renamed it), made writable again there."""
    folder.chmod(0o555)
    immutable = (
        os.geteuid() == 0
        and shutil.which("chattr") is not None
        and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    )
    try:
        probe = folder / "probe"
        with contextlib.suppress(OSError):
            probe.write_text("x")
            probe.unlink()
            pytest.skip("cannot make a directory unwritable here")
        yield
    finally:
        folder = moved_to or folder
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def edit_index(step: Path, change, name: str = "index.json") -> None:
    index = json.loads((step / name).read_text())
    change(index)
    (step / name).write_text(json.dumps(index))


def launched(script: str, argv: list[str]) -> dict:
    """Run ``script`` as ``python script argv`` would, in this process: its exit code and output; an exception
    that escapes its own handling is recorded as code "traceback"."""
    out, err, real_exit = io.StringIO(), io.StringIO(), os._exit
    sys.argv = [script, *argv]

    def exit_(code):
        raise SystemExit(code)

    os._exit = exit_  # launch/pretrain.py ends with os._exit (skipping teardown): here it must return
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    except Exception:  # noqa: BLE001 - what the user would have seen as a traceback
        code, err = "traceback", io.StringIO(err.getvalue() + traceback.format_exc())
    finally:
        os._exit = real_exit
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}
