"""End-to-end training through the Trainer: the tiny model learns, and at tp 2 the training and
validation losses (fp32, rel <= 1e-5) and grad norms (rel <= 1e-4) follow the single-process run. Every other
layout is compared with one process by the parity matrix (tests/test_parity.py)."""

from __future__ import annotations

import json

import pytest

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks


def train(argv: list[str]) -> list[dict]:
    """Rank function: build the config and context as launch/pretrain.py does and train."""
    cfg = load(argv)
    return Trainer(cfg, ParallelContext.from_config(cfg)).fit()


def losses(history: list[dict]) -> list[float]:
    return [r["loss"] for r in history]


@pytest.mark.slow  # 60 steps of the quick start; CI: the tp1/tp2 loss curves below
def test_tiny_loss_falls(tmp_path):
    """The README's quick start, shortened to 60 steps (its warmup, then a cosine over the rest): the model learns.
    The full 200 steps took two minutes of CI; the check is the same."""
    steps = 60
    argv = [
        "--config",
        "configs/tiny.yaml",
        "--train.out_dir",
        str(tmp_path),
        "--log.progress",
        "false",
        "--train.steps",
        str(steps),
    ]
    (history,) = run_ranks(train, 1, argv, timeout_s=600)
    curve = losses(history)
    assert len(curve) == steps
    last = sum(curve[-10:]) / 10
    assert curve[0] > 7.8  # ~ln(4096) = 8.3 at initialisation: the model starts from chance
    # measured: 8.37 -> 5.48, 0.655 of the start; a model that does not learn stays near 1.0
    assert last < 0.75 * curve[0], f"loss fell only from {curve[0]:.3f} to {last:.3f} (mean of the last 10)"
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    assert set(logged[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    assert [r["loss"] for r in logged] == curve


def _short_run(tmp_path, world: int, *extra: str, **spawn) -> dict:
    """Losses of 20 steps with the two validation losses, and the global grad norms (clipping is active: the norm
    starts near 3.5 > 1.0), so a grad norm that counted tp-replicated parameters tp times would show. ``spawn``:
    run_ranks' threads. 600 s: one process at two threads took over 120 s on a loaded 2-core machine."""
    argv = [
        "--config",
        "configs/tiny.yaml",
        "--train.steps",
        "20",
        "--train.out_dir",
        str(tmp_path),
        "--log.progress",
        "false",
        "--train.eval_every",
        "10",
        *extra,
    ]
    history = run_ranks(train, world, argv, timeout_s=600, **spawn)[0]
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    assert len(evals) == 2  # held-out loss at steps 10 and 20
    return {"loss": losses(history) + evals, "grad_norm": [r["grad_norm"] for r in history]}


# Bounds of tp 2 against one process over those 20 steps, from the worst error of correct code under every CPU
# kernel path measured (ATen default/avx2/avx512, MKL AVX2/AVX-512, oneDNN AVX2/AMX; 1 and 2 threads: the table
# in tests/test_kernel_paths.py) and two defects the test must catch: norm weights counted on both tp ranks in the
# grad norm, and tp rank 1's sharded gradients scaled by 1 + 1e-3. Losses stay within 1e-5 (correct: <= 1.6e-7;
# the defects: 6.3e-5 and 2.4e-5). The grad norm is the sensitive one: Adam turns reordered fp32 sums into
# diverging updates, and the last step's norm measured 1.53e-5 (AVX-512 path), over the 1e-5 the loss keeps;
# the defects give 5.8e-3 and 1.9e-3. 1e-4 sits between them.
LOSS_REL, GRAD_NORM_REL = 1e-5, 1e-4


def assert_runs_match(got: dict, want: dict) -> None:
    assert_curves_match(got["loss"], want["loss"], LOSS_REL)
    assert_curves_match(got["grad_norm"], want["grad_norm"], GRAD_NORM_REL, what="grad norms")


def assert_curves_match(got: list[float], want: list[float], rel: float = LOSS_REL, what: str = "loss curves") -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= rel, f"{what} differ by rel {worst:.2e} > {rel}: {got} vs {want}"


@pytest.fixture(scope="module")
def tp1_curve(tmp_path_factory):
    return _short_run(tmp_path_factory.mktemp("tp1"), 1)


def test_tp2_follows_tp1_loss_curve(tmp_path, tp1_curve):
    assert_runs_match(_short_run(tmp_path, 2, "--parallel.tp", "2"), tp1_curve)


def test_bf16_autocast_is_close_to_fp32(tmp_path):
    # bf16 matmuls are slow on CPUs without bf16 units, so this compares 2 small steps only; bf16 keeps ~3
    # significant digits, hence the looser bound.
    small = [
        "--train.steps",
        "2",
        "--train.global_batch_size",
        "4",
        "--train.out_dir",
        str(tmp_path),
        "--config",
        "configs/tiny.yaml",
        "--log.progress",
        "false",
    ]
    fp32 = losses(run_ranks(train, 1, small)[0])
    bf16 = losses(run_ranks(train, 1, [*small, "--train.dtype", "bf16"])[0])
    assert_curves_match(bf16, fp32, rel=2e-2)
    assert bf16 != fp32  # autocast really ran in bf16
