"""Data parallelism (ddp, fsdp with and without resharding) against the dp = 1 run with the same global batch:
the loss curve over 10 steps (rel <= 1e-5 at every step) and every parameter after them (fp32, relative L2 error
||a - b|| / ||b|| <= 1e-5), also composed with tp and pp.

Why parameters are compared in L2 and with Adam eps = 1e-6: a gradient element that is a sum of nearly cancelling
terms carries rounding noise that is large relative to itself, and Adam, which normalises each element, turns it
into an update of order lr * |g| / (|g| + eps) with a noisy sign. Any other but equally valid summation order
(more dp ranks, FSDP's reduce-scatter pre-dividing by sqrt(dp)) then moves such elements by ~1e-5 after 10 steps
with eps = 1e-8 (measured: embedding rel L2 2e-5 at dp=4), while the losses agree to 1e-7. A larger eps bounds that
amplification (noise / eps) without changing what is tested."""
from __future__ import annotations

import pytest
import torch

from engine.config import load
from engine.parallel.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.test_train import assert_curves_match, losses

SMALL = ["--config", "configs/tiny.yaml", "--model.num_layers", "4", "--model.hidden_size", "64",
         "--model.intermediate_size", "128", "--model.num_heads", "4", "--model.num_kv_heads", "2",
         "--train.seq_len", "32", "--train.micro_batch_size", "1", "--train.global_batch_size", "8",
         "--train.steps", "10", "--train.warmup_steps", "2", "--train.adam_eps", "1e-6", "--log.progress", "false"]
MODES = {"ddp": ["--parallel.dp_mode", "ddp"],
         "fsdp-reshard": ["--parallel.dp_mode", "fsdp", "--parallel.reshard_after_forward", "true"],
         "fsdp-keep": ["--parallel.dp_mode", "fsdp", "--parallel.reshard_after_forward", "false"]}


def train_and_params(argv: list[str]) -> dict:
    """Rank function: 10 steps, then every parameter as this rank holds it after un-sharding over dp
    (the tp shard stays a shard; tp_dims says along which dim)."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    history = trainer.fit()
    params = {}
    for mod_name, module in trainer.model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP: gather the dp shards
            params[f"{mod_name}.{attr}"] = (full.detach().clone(), getattr(module, "tp_dims", {}).get(attr),
                                            getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1))
    return {"losses": losses(history), "params": params}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(train_and_params, 1, [*SMALL, "--train.out_dir", str(tmp_path_factory.mktemp("ref"))])[0]


def check_against(results: list[dict], ref: dict, rel: float = 1e-5) -> None:
    for rank, got in enumerate(results):
        assert_curves_match(got["losses"], ref["losses"], rel)
        for name, (value, dim, tp_rank, tp_size) in got["params"].items():
            want = ref["params"][name][0]
            if dim is not None:
                want = want.chunk(tp_size, dim=dim)[tp_rank]
            err = ((value - want).norm() / want.norm()).item()
            assert err <= rel, f"rank {rank}: {name} after 10 steps differs by rel {err:.2e}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_dp1(tmp_path, reference, mode, dp):
    argv = [*SMALL, *MODES[mode], "--parallel.dp", str(dp), "--train.out_dir", str(tmp_path)]
    check_against(run_ranks(train_and_params, dp, argv), reference)


@pytest.mark.parametrize("mode", list(MODES))
def test_tp2_dp2_matches_single_process(tmp_path, reference, mode):
    argv = [*SMALL, *MODES[mode], "--parallel.tp", "2", "--train.out_dir", str(tmp_path)]
    check_against(run_ranks(train_and_params, 4, argv), reference)


def test_fsdp_tp2_pp2_dp2_matches_single_process(tmp_path, reference):
    argv = [*SMALL, *MODES["fsdp-keep"], "--parallel.tp", "2", "--parallel.pp", "2", "--train.out_dir",
            str(tmp_path)]
    check_against(run_ranks(train_and_params, 8, argv, timeout_s=300), reference)


def test_fsdp_bf16_mixed_precision_is_close(tmp_path, reference):
    # bf16 weights in compute (MixedPrecisionPolicy) with fp32 master weights and fp32 gradient reduction:
    # about 3 significant digits per op, so the loss curve is checked to 2e-2 and parameters are not compared.
    argv = [*SMALL, *MODES["fsdp-reshard"], "--parallel.dp", "2", "--train.dtype", "bf16", "--train.out_dir",
            str(tmp_path)]
    got = run_ranks(train_and_params, 2, argv)[0]
    assert_curves_match(got["losses"], reference["losses"], rel=2e-2)
    assert got["losses"] != reference["losses"]


def test_fsdp_bf16_under_pipeline_is_close(tmp_path, reference):
    # FSDP's bf16 compute makes a stage's output bf16 while activations travel in fp32 between stages: the
    # executor casts on send; without it the pp=2 run fails on mismatched p2p buffers.
    argv = [*SMALL, *MODES["fsdp-keep"], "--parallel.pp", "2", "--parallel.dp", "2", "--train.dtype", "bf16",
            "--train.out_dir", str(tmp_path)]
    for got in run_ranks(train_and_params, 4, argv):
        assert_curves_match(got["losses"], reference["losses"], rel=2e-2)
