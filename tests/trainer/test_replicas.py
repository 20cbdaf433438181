"""train.check_replicas_every (engine/trust/replicas.py): one bit flipped in one rank's weight or gradient mid-run is
caught at the next check, naming the step, the rank and the tensor, before that step's save; a clean run names
nothing. The fault is injected through the trainer's observers (the hook launch/bench/measure.py uses): at the
"update" event of step 3, after the gradients are reduced and before the optimizer step, on one rank only."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from engine.trust.replicas import ReplicasDisagree, describe, digest, span
from tests.cli import run_script
from tests.cluster.jobs import Job, agent
from tests.dist import free_port, run_ranks
from tests.shrunk import FIVE_STEPS


def flip_bit(t: torch.Tensor, bit: int = 20) -> None:
    """Flip one bit of element 0 of a float32 tensor, in place (a mantissa bit: the value stays finite)."""
    t.view(torch.int32).view(-1)[0] ^= 1 << bit


def faulty_run(argv: list[str], rank: int, what: str, pick: str, every: bool = False) -> dict:
    """Rank function: train; at step 3's update flip a bit of ``what`` (weight or grad) of the first parameter whose
    name contains ``pick`` (``every``: of each of them), on global rank ``rank``. Returns the error line (or None)
    and the flipped names."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    picked = [(n, p) for n, p in trainer.model.named_parameters() if pick in n][: None if every else 1]
    name, names = picked[0][0], [n for n, _ in picked]

    def inject(event: str) -> None:
        if event == "update" and trainer.step == 2 and trainer.ctx.rank == rank:
            for _, param in picked:
                flip_bit(param.grad if what == "grad" else param.data)

    trainer.observers.append(inject)
    try:
        trainer.fit()
    except ReplicasDisagree as e:
        return {"error": str(e), "name": name, "names": names, "step": trainer.step}
    return {"error": None, "name": name, "names": names, "step": trainer.step}


def argv_for(tmp_path, *layout: str) -> list[str]:
    return [
        *FIVE_STEPS,
        *("--train.steps", "6", "--train.global_batch_size", "12", "--train.micro_batch_size", "2"),
        *("--train.check_replicas_every", "2", "--checkpoint.every", "2"),
        *("--train.out_dir", str(tmp_path / "out"), "--checkpoint.dir", str(tmp_path / "ckpt")),
        *layout,
    ]


def saved_steps(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))


@pytest.mark.parametrize("what", ["weight", "grad"])
def test_dp_replica_that_drifts_is_named(tmp_path, what):
    """dp 3 (ddp): rank 2's copy differs from ranks 0 and 1 after step 3; the check at step 4 names it and the run
    ends before step 4's save, so step 2 (checked, clean) stays the latest checkpoint."""
    got = run_ranks(faulty_run, 3, argv_for(tmp_path, "--parallel.dp", "3"), 2, what, "layers.1.mlp", timeout_s=300)
    assert all(g["error"] == got[0]["error"] for g in got), got  # every rank stops with the same line
    error, name = got[0]["error"], got[0]["name"]
    assert error is not None and error.startswith("replicas disagree at step 4: "), error
    assert "on rank 2 differs from ranks 0, 1 (dp_cp group of ranks 0-2)" in error, error
    if what == "weight":  # only that tensor differs; a flipped gradient also moves the clipping of every tensor
        assert (
            error == f"replicas disagree at step 4: {name} on rank 2 differs from ranks 0, 1 (dp_cp group of ranks 0-2)"
        )
    assert saved_steps(tmp_path) == ["step_000002"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000002"


def test_tp_replicated_norm_that_drifts_is_named(tmp_path):
    """tp 2: the final norm, which both tp ranks hold whole, flipped on rank 1: two copies, so both are named."""
    got = run_ranks(faulty_run, 2, argv_for(tmp_path, "--parallel.tp", "2"), 1, "weight", "model.norm", timeout_s=300)
    error, name = got[0]["error"], got[0]["name"]
    assert error == (
        f"replicas disagree at step 4: {name} differs between ranks 0, 1 (tp group of ranks 0, 1), no majority to "
        "tell which is wrong"
    ), error
    assert got[1]["error"] == error
    assert saved_steps(tmp_path) == ["step_000002"]


def test_many_drifting_tensors_are_named_three_and_counted(tmp_path):
    """dp 2, the four attention weights (two layers' qkv and o) flipped on rank 1: the line names the first three and
    counts the fourth (four: a fourth line named, or the count dropped, shows)."""
    got = run_ranks(faulty_run, 2, argv_for(tmp_path, "--parallel.dp", "2"), 1, "weight", "self_attn", True)
    names, group = got[0]["names"], "differs between ranks 0, 1 (dp_cp group of ranks 0, 1), no majority to tell which"
    assert len(names) == 4, names
    assert (
        got[1]["error"]
        == got[0]["error"]
        == (
            "replicas disagree at step 4: "
            + "; ".join(f"{n} {group} is wrong" for n in names[:3])
            + " (and 1 more tensors)"
        )
    )


def test_experts_are_compared_over_expert_dp_and_the_rest_over_dp(tmp_path):
    """dp 4 x ep 2 (MoE): each ep rank holds other experts, so experts are compared only between the ranks that
    hold the same ones (edp) and every other weight over dp. Layer 1's router and experts flipped on rank 1."""
    argv = argv_for(tmp_path, "--parallel.dp", "4", "--parallel.ep", "2", "--model.num_experts", "4")
    argv[argv.index("configs/tiny.yaml")] = "configs/tiny-moe.yaml"
    argv[argv.index("12")] = "8"  # global batch: one micro-batch of 2 per dp rank
    got = run_ranks(faulty_run, 4, argv, 1, "weight", "layers.1.mlp.", True, timeout_s=300)
    assert got[0]["names"] == [
        f"model.layers.1.mlp.{n}" for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
    ]
    assert [g["error"] for g in got] == [got[0]["error"]] * 4
    edp = "differs between ranks 1, 3 (edp group of ranks 1, 3), no majority to tell which is wrong"
    assert got[0]["error"] == (
        "replicas disagree at step 4: model.layers.1.mlp.gate.weight on rank 1 differs from ranks 0, 2, 3 (dp_cp "
        f"group of ranks 0-3); model.layers.1.mlp.experts.down_proj {edp}; "
        f"model.layers.1.mlp.experts.gate_up_proj {edp}"
    )


def test_a_due_save_is_checked_between_checks(tmp_path):
    """check_replicas_every 100, checkpoint.every 2: step 4's save is checked all the same."""
    argv = [*argv_for(tmp_path, "--parallel.tp", "2"), "--train.check_replicas_every", "100"]
    got = run_ranks(faulty_run, 2, argv, 1, "weight", "model.norm", timeout_s=300)
    assert got[0]["error"].startswith("replicas disagree at step 4: model.norm.weight differs between ranks 0, 1")
    assert saved_steps(tmp_path) == ["step_000002"]


def test_clean_run_names_nothing(tmp_path):
    """tp 2 x dp 2, checked every step over both groups: the run finishes and saves its last step."""
    argv = [*argv_for(tmp_path, "--parallel.tp", "2", "--parallel.dp", "2"), "--train.check_replicas_every", "1"]
    argv[argv.index("12")] = "8"  # global batch: 2 micro-batches of 2 per dp rank
    got = run_ranks(faulty_run, 4, argv, -1, "weight", "model.norm", timeout_s=300)
    assert [g["error"] for g in got] == [None] * 4 and got[0]["step"] == 6
    assert saved_steps(tmp_path)[-1] == "step_000006"


def test_negative_interval_refused(tmp_path):
    r = run_script("launch/pretrain.py", *FIVE_STEPS, "--train.check_replicas_every", "-1")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: train.check_replicas_every=-1 must be >= 0 (0: off, N: every N steps)"
    ], r.stderr


def test_launcher_stops_with_exit_status_4(tmp_path):
    """Through torchrun and launch/pretrain.py (tests/trainer/flip_pretrain.py flips rank 1's bit in step 3): one
    error line, worker exit status 4, the step-2 checkpoint the latest."""
    job = Job(tmp_path)
    args = ["tests/trainer/flip_pretrain.py", *argv_for(tmp_path, "--parallel.dp", "2")]
    env = {**os.environ, "FLIP_AT": "1:3:layers.1.mlp"}
    try:
        proc = job.start(agent(1, 2, f"127.0.0.1:{free_port()}", args), env)
        assert job.wait([proc])[0] != 0
    finally:
        job.kill_all()
    out = job.output()
    assert "error: replicas disagree at step 4: model.layers.1.mlp." in out and "exitcode  : 4" in out, out[-3000:]
    assert " differs between ranks 0, 1 (dp_cp group of ranks 0, 1)" in out, out[-3000:]
    assert saved_steps(tmp_path) == ["step_000002"]


def test_a_digest_changes_with_any_bit_of_any_dtype_and_not_with_the_layout():
    """digest() of one flipped bit, per element size (uint8, bf16, fp32, fp64) and in a strided view."""
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float64):
        t = torch.arange(24).reshape(4, 6).to(dtype)
        flipped = t.clone()
        flipped.view(-1)[5:6].view(torch.uint8)[0] ^= 1
        assert not torch.equal(digest(t), digest(flipped)), dtype
        assert torch.equal(digest(t.t()), digest(t.t().contiguous())) and torch.equal(digest(t), digest(t.clone()))


def test_the_line_names_the_odd_ranks_or_every_rank_without_a_majority():
    a, b = (1, 2), (3, 4)
    assert describe("w", [a, b, a, a], [4, 5, 6, 7], "dp_cp") == (
        "w on rank 5 differs from ranks 4, 6, 7 (dp_cp group of ranks 4-7)"
    )
    assert describe("w", [b, a, b, a, a], [0, 2, 4, 6, 8], "edp") == (
        "w on ranks 0, 4 differs from ranks 2, 6, 8 (edp group of ranks 0, 2, 4, 6, 8)"
    )
    assert describe("w", [a, b, b, a], [0, 1, 2, 3], "tp") == (
        "w differs between ranks 0-3 (tp group of ranks 0-3), no majority to tell which is wrong"
    )
    assert [span(r) for r in ([0, 1, 2, 5], [0, 1], [3], [0, 2, 3, 4, 5, 9, 10])] == [
        "0-2, 5",
        "0, 1",
        "3",
        "0, 2-5, 9, 10",
    ]
