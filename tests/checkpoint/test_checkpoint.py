"""Sharded checkpoints (engine/checkpoint/checkpointer.py): a resumed run is the uninterrupted run.

- Same layout (ddp, fsdp, zero; with pp 2 and with tp 2): 20 steps straight vs. resume from the step-10
  checkpoint and 10 more: the same loss at every step (fp32, rel <= 1e-6; in practice bit-identical).
- Another layout (tp2 -> tp1, tp1 -> tp2 pp2, dp4 -> dp2, fsdp dp2 -> ddp pp2, zero-2 dp2 -> fsdp dp4, zero-3
  dp2 tp2 -> zero-1 dp2 pp2): every resumed step's loss equals the uninterrupted run's (rel <= 1e-5, the
  tolerance between layouts in tests/trainer/test_train.py), so weights, both Adam moments and the step count were all
  resharded.
- Damaged checkpoints (a truncated shard, a missing shard, flipped bytes, an index that does not match its
  shards, a cut-short save) are skipped by ``resume: auto`` with the file named; a PATH that does not exist is a
  one-line error; SIGTERM to one rank saves on all and stops them at the same step.
Each scenario is a list of phases run one after another in one set of forked ranks (one Trainer per phase), so the
ranks start and import once.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from engine.checkpoint.checkpointer import Checkpointer
from engine.config import ConfigError, load
from tests.checkpoint.runs import (
    DDP_DP2_PP2,
    FSDP_PP2,
    FSDP_TP2,
    MOVED,
    SAME,
    SMALL,
    TIED,
    TP2_PP2,
    check_resumes,
    files,
    run_phases,
    zero,
)
from tests.cli import ROOT, run_script
from tests.cluster.jobs import per_step
from tests.dist import run_ranks


@pytest.mark.slow  # CI: the parity matrix's resumes (tests/trainer/test_parity.py) cross ddp, fsdp and layouts
def test_ddp_and_fsdp_resume_at_the_same_and_at_other_layouts(tmp_path):
    check_resumes(
        tmp_path,
        4,
        {
            "ddp dp4": ([], [("same layout", [], SAME), ("dp2 pp2", DDP_DP2_PP2, MOVED), ("tp2 pp2", TP2_PP2, MOVED)]),
            "ddp tp2 pp2": (TP2_PP2, [("same layout", TP2_PP2, SAME), ("tp1 dp4", [], MOVED)]),
            "fsdp dp2 tp2": (FSDP_TP2, [("same layout", FSDP_TP2, SAME), ("ddp dp2 pp2", DDP_DP2_PP2, MOVED)]),
            "fsdp dp2 pp2": (FSDP_PP2, [("same layout", FSDP_PP2, SAME)]),
            # Saved under pp 2 the last stage's copy of a tied embedding is not written; loaded under pp 2 it is read
            # from the embedding's pieces.
            "tied ddp tp2 pp2": ([*TIED, *TP2_PP2], [("tied fsdp dp2 pp2", [*TIED, *FSDP_PP2], MOVED)]),
        },
    )


def test_zero_resumes_at_the_same_and_at_other_layouts(tmp_path):
    pytest.importorskip("deepspeed")
    z2_pp2, z3_tp2 = zero(2, *DDP_DP2_PP2), zero(3, "--parallel.tp", "2")
    check_resumes(
        tmp_path,
        4,
        {
            "zero-2 dp2 pp2": (
                z2_pp2,
                [("same layout", z2_pp2, SAME), ("fsdp dp4", ["--parallel.dp_mode", "fsdp"], MOVED)],
            ),
            "zero-3 dp2 tp2": (
                z3_tp2,
                [("same layout", z3_tp2, SAME), ("zero-1 dp2 pp2", zero(1, *DDP_DP2_PP2), MOVED)],
            ),
        },
    )


def test_damaged_checkpoints_fall_back_and_a_signal_saves(tmp_path):
    c, s = tmp_path / "c", tmp_path / "signal"
    every4 = [
        "--checkpoint.dir",
        str(c),
        "--checkpoint.every",
        "4",
        "--checkpoint.keep",
        "0",
        "--checkpoint.async_save",
        "true",
        "--train.out_dir",
        str(tmp_path / "out"),
    ]
    auto = [*SMALL, *every4, "--checkpoint.resume", "auto"]
    out = ["--train.out_dir", str(tmp_path / "out")]
    on_signal = ["--checkpoint.dir", str(s), *out]
    phases = [
        ("train", [*SMALL, *every4, "--checkpoint.resume", "none"]),  # saves 4, 8, ..., 20 (async)
        (
            "damage",
            [
                ("truncate", c / "step_000020" / "rank_00001.safetensors"),
                ("remove", c / "step_000016" / "rank_00000.safetensors"),
                ("flip", c / "step_000012" / "rank_00001.safetensors"),
                ("index", c / "step_000008" / "part_00000.json"),
                ("partial", c / "step_000024.tmp-cutshort"),
            ],
        ),
        ("train", auto),  # falls back to step 4, trains to 20, saves 8, ..., 20 again
        ("train", auto),  # latest (the new step 20) is good: nothing left to train
        ("error", [*SMALL, *out, "--checkpoint.resume", str(tmp_path / "nonexistent")]),
        ("error", [*SMALL, *out, "--model.hidden_size", "128", "--checkpoint.resume", str(c / "step_000020")]),
        ("signal", ([*SMALL, *on_signal, "--checkpoint.resume", "none"], 1, 7)),  # SIGTERM to rank 1 only
        ("train", [*SMALL, *on_signal, "--checkpoint.keep", "1"]),
    ]  # resumes at 7; keeps only step 20
    r = run_ranks(run_phases, 2, phases, timeout_s=300)[0]
    full = r[0]["loss"]
    assert r[2]["start"] == 4 and r[2]["loss"] == full[4:], "auto did not fall back to the good step 4"
    truncated, removed, flipped, mismatched = r[2]["skipped"]
    assert "step_000020/rank_00001.safetensors has" in truncated and "truncated" in truncated
    assert "step_000016/rank_00000.safetensors" in removed and "missing" in removed
    assert "step_000012/rank_00001.safetensors fails its CRC-32" in flipped
    assert "does not hold piece" in mismatched and "step_000008/part_00000.json" in mismatched
    assert r[3]["start"] == 20 and r[3]["loss"] == [] and r[3]["skipped"] == []
    assert "nonexistent' does not exist" in r[4] and r[4].startswith("checkpoint.resume")
    assert "model.hidden_size=64" in r[5] and "128" in r[5]
    assert r[6]["end"] == 7 and r[6]["loss"] == full[:7], "the signalled run did not stop after step 7"
    assert r[7]["start"] == 7 and r[7]["loss"] == full[7:], "the resume after the signal differs"
    assert sorted(p.name for p in s.iterdir()) == ["latest", "step_000020"]
    # The cut-short save was ignored, then cleaned up by the next successful save; the damaged steps above the
    # one resumed from were set aside (engine/checkpoint/lineage.py), not deleted.
    assert sorted(p.name for p in c.iterdir()) == [
        "latest",
        "set_aside",
        *(f"step_{i:06d}" for i in (4, 8, 12, 16, 20)),
    ]
    assert sorted(p.name.split("-")[0] for p in (c / "set_aside").iterdir()) == [
        f"step_{i:06d}" for i in (8, 12, 16, 20)
    ]


def test_pretrain_sigterm_saves_and_exits_0_and_a_bad_path_exits_2(tmp_path):
    cmd = [
        sys.executable,
        "launch/pretrain.py",
        *SMALL,
        "--train.steps",
        "1000",
        "--checkpoint.dir",
        str(tmp_path / "c"),
        "--train.out_dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    steps = len(metrics.read_text().splitlines())
    assert (tmp_path / "c" / "latest").read_text().strip() == f"step_{steps:06d}", out[-2000:]
    bad = run_script(
        "launch/pretrain.py",
        *SMALL,
        "--train.out_dir",
        tmp_path,
        "--checkpoint.resume",
        tmp_path / "missing",
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("error: checkpoint.resume"), bad.stderr[-2000:]
    shutil.rmtree(tmp_path / "c")


def test_resume_at_tp2_dp3_is_bit_identical(tmp_path):
    """Issue 42 item 6: a resume at tp 2 x dp 3 (DDP) repeats the uninterrupted run bit for bit: the same losses
    and gradient norms (==) and byte-identical shards at the last step. Before, torch's DDP reduced its first
    step (a resumed run's first) in one bucket scaled by 1/3 and later steps in rebuilt buckets divided by 3: three
    summands in another order, an ulp apart in most gradients (engine/parallel/dp/ddp.py static_buckets). dp 2's
    two-term sums hid it. Six forked ranks (a fresh DDP per run, as a fresh torchrun's; 27 s under torchrun, most
    of it twelve process starts): the uninterrupted run to step 6, then a run resuming its step-3 checkpoint."""
    args = [*SMALL, "--train.steps", "6", "--train.global_batch_size", "12", "--train.micro_batch_size", "2"]
    args += ["--parallel.tp", "2", "--checkpoint.every", "3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    phases = [
        ("train", [*args, "--checkpoint.dir", str(straight), "--train.out_dir", str(straight / "out")]),
        (
            "train",
            [
                *args,
                "--checkpoint.dir",
                str(resumed),
                "--train.out_dir",
                str(resumed / "out"),
                "--checkpoint.resume",
                str(straight / "step_000003"),
            ],
        ),
    ]
    run_ranks(run_phases, 6, phases, timeout_s=300)
    before, after = per_step(straight / "out"), per_step(resumed / "out")
    assert sorted(after) == [4, 5, 6]
    for step, record in after.items():
        assert (record["loss"], record["grad_norm"]) == (before[step]["loss"], before[step]["grad_norm"]), step
    want, got = files(straight / "step_000006"), files(resumed / "step_000006")
    shards = [name for name in want if name.startswith("rank_")]
    assert len(shards) == 6 and [n for n in shards if got[n] != want[n]] == [], "step 6's shards differ"


@pytest.mark.parametrize(
    "arg,value,words",
    [
        ("every", "-1", "checkpoint.every=-1"),
        ("keep", "-2", "checkpoint.keep=-2"),
        ("resume", "", "checkpoint.resume is empty"),
    ],
)
def test_checkpoint_config_is_checked(arg, value, words):
    with pytest.raises(ConfigError, match=words):
        load([*SMALL, f"--checkpoint.{arg}", value])


def stalled_exchange(argv: list[str]) -> str | None:
    """Rank function: rank 1 stays alive but never joins the checkpointer's metadata exchange (a rank stuck during
    a save). Rank 0's exchange through the store must fail by parallel.timeout_s, naming rank 1; meanwhile rank
    1 waits on the world group, whose timeout is the spawner's, so a rank 0 that stalls
    fails the test through rank 1's barrier or the spawner instead of passing. Returns rank 0's error."""
    cfg = load(argv)
    ckpt = Checkpointer(cfg, SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size()))
    error = None
    if dist.get_rank() == 0:
        try:
            ckpt.exchange.gather("rank 0's piece list")
        except RuntimeError as e:
            error = str(e)
    dist.barrier()
    return error


def test_checkpoint_exchange_times_out_after_parallel_timeout_s(tmp_path):
    # 3 s: long enough for rank 0 to claim the directory before rank 1 gives up on the start-up broadcast.
    argv = [
        *SMALL,
        "--checkpoint.dir",
        str(tmp_path / "c"),
        "--train.out_dir",
        str(tmp_path / "out"),
        "--parallel.timeout_s",
        "3",
    ]
    error = run_ranks(stalled_exchange, 2, argv, timeout_s=60)[0]
    assert error is not None and "rank(s) 1 did not reach" in error and "3 s (parallel.timeout_s)" in error, error
