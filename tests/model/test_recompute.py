"""Activation checkpointing modes (engine/model/recompute.py): full and selective give the loss and every gradient
of no checkpointing (fp32), at tp = 1 and tp = 2; selective keeps less than none and more than full; the old
boolean spellings still load."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config import Config, ConfigError, ModelConfig, TrainConfig, load
from engine.metrics.memory import LiveTensorBytes
from engine.model import transformer as model_lib
from engine.model.init import materialize
from engine.model.recompute import apply_activation_checkpointing
from engine.parallel.tp.layers import apply_tensor_parallel, vocab_parallel_cross_entropy
from engine.planning.activations import checkpointed_layer_bytes_per_token
from tests.dist import run_ranks

SHAPE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
# Measured: recomputation repeats the same ops on the same values, so loss and gradients are bitwise equal (0.0)
# at tp = 1 and 2; the bound only allows for a kernel choosing another reduction order when recomputing.
REL = 1e-6


def _run(mode: str, group=None) -> tuple[torch.Tensor, dict, int]:
    """(loss, gradients by name, bytes allocated by the forward and still alive at the loss) of one step."""
    model = model_lib.build(SHAPE, device="meta")
    if group is not None:
        apply_tensor_parallel(model, group)
    materialize(model, torch.device("cpu"), seed=0, std=0.1)
    apply_activation_checkpointing(model, mode)
    ids = torch.randint(0, SHAPE.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with LiveTensorBytes() as live:
        loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], group)
        kept = live.live
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept


def _worst(a: tuple, b: tuple) -> float:
    errs = [((a[0] - b[0]).abs() / b[0].abs()).item()]
    errs += [((a[1][n] - g).abs().max() / g.abs().max()).item() for n, g in b[1].items()]
    return max(errs)


def _compare(group=None) -> dict:
    runs = {mode: _run(mode, group) for mode in ("none", "full", "selective")}
    return {
        "full": _worst(runs["full"], runs["none"]),
        "selective": _worst(runs["selective"], runs["none"]),
        "kept": {mode: r[2] for mode, r in runs.items()},
    }


def _tp_rank() -> dict:
    return _compare(dist.group.WORLD)


def test_modes_match_no_checkpointing_and_keep_less():
    got = _compare()
    assert got["full"] <= REL and got["selective"] <= REL, got
    kept = got["kept"]
    assert kept["full"] < kept["selective"] < kept["none"], kept
    # What selective keeps beyond full (the matmul outputs) is what the planner counts, exactly.
    cfg = {m: Config(model=SHAPE, train=TrainConfig(activation_checkpointing=m)) for m in ("full", "selective")}
    extra = checkpointed_layer_bytes_per_token(cfg["selective"], 1) - checkpointed_layer_bytes_per_token(cfg["full"], 1)
    assert kept["selective"] - kept["full"] == extra * 2 * 16 * SHAPE.num_layers  # (2, 16) tokens


def test_modes_match_at_tp2():
    for got in run_ranks(_tp_rank, 2):
        assert got["full"] <= REL and got["selective"] <= REL, got
        assert got["kept"]["full"] < got["kept"]["selective"] < got["kept"]["none"], got["kept"]


@pytest.mark.parametrize(
    "value,mode", [("true", "full"), ("false", "none"), ("selective", "selective"), ("none", "none")]
)
def test_old_boolean_spellings_load(value, mode):
    assert load(["--train.activation_checkpointing", value]).train.activation_checkpointing == mode


def test_bad_mode_is_refused():
    with pytest.raises(ConfigError, match="train.activation_checkpointing='some' is not one of none, full, selective"):
        load(["--train.activation_checkpointing", "some"])
