"""engine.optim.build_optimizer picks torch's fused AdamW (CUDA, CPU) or foreach (mixed devices), and that gives
torch's per-tensor loop's result up to rounding, on plain and on FSDP2-sharded (DTensor) parameters; the gradient
norm and clipping equal the loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from engine.config import ModelConfig, TrainConfig
from engine.model import transformer as model_lib
from engine.optim import SQUARES_CHUNK, adamw_implementation, build_optimizer, clip_gradients, sum_of_squares
from engine.parallel.dp.fsdp import apply_fsdp
from tests.dist import run_ranks

SHAPE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
TRAIN = TrainConfig(lr=1e-2, weight_decay=0.1)
# Measured: fused (and foreach) and the loop agree exactly (0.0, worst parameter) after 3 steps on torch 2.13 CPU
# (on the tiny model's shapes after 25 steps fused and foreach differ by 6e-8 absolute); 1e-6 leaves room for other
# CPUs' vector widths and is far below any real difference (one lr step is ~1e-2 relative).
REL = 1e-6


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_lib.build(SHAPE, device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int = 3) -> None:
    ids = torch.randint(0, SHAPE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        model(ids[:, :-1]).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _worst_rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    return max(
        ((local(p) - local(q)).abs().max() / local(q).abs().max()).item()
        for p, q in zip(a.parameters(), b.parameters())
    )


def _loop_twin(model: torch.nn.Module) -> torch.optim.Optimizer:
    """build_optimizer's groups, run by torch's per-tensor loop."""
    opt = build_optimizer(model, TRAIN)
    for group in opt.param_groups:
        group["foreach"] = False
    return opt


def test_choice_by_device():
    cpu = build_optimizer(_model(), TRAIN)
    assert all(g["fused"] and not g["foreach"] for g in cpu.param_groups)
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert adamw_implementation([cuda, cuda]) == {"fused": True}
    assert adamw_implementation([cuda, SimpleNamespace(device=torch.device("cpu"))]) == {"foreach": True}
    assert adamw_implementation([SimpleNamespace(device=torch.device("meta"))]) == {"foreach": True}


def test_fused_matches_the_per_tensor_loop():
    fast, slow = _model(), _model()
    _steps(fast, build_optimizer(fast, TRAIN))
    _steps(slow, _loop_twin(slow))
    assert _worst_rel(fast, slow) <= REL


def _fsdp_rank() -> float:
    mesh = init_device_mesh("cpu", (2,))
    fast, slow = (apply_fsdp(_model(), mesh, reshard_after_forward=True, bf16=False) for _ in range(2))
    opt = build_optimizer(fast, TRAIN)
    assert all(g["fused"] for g in opt.param_groups)
    _steps(fast, opt)
    _steps(slow, _loop_twin(slow))
    return _worst_rel(fast, slow)


def test_fused_on_fsdp2_dtensor_parameters():
    for err in run_ranks(_fsdp_rank, 2):
        assert err <= REL


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    ids = torch.randint(0, SHAPE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids[:, :-1]).float().logsumexp(-1).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_norm_and_clip_equal_the_per_tensor_loop(monkeypatch):
    """global_grad_norm and clip_gradients (one process: every parameter replicated, counted on tp rank 0) give the
    loop's sqrt(sum ||g||^2) and g * min(1, max_norm / (norm + 1e-6)), the scaling through one _foreach_mul_ (the
    spy), not a kernel per tensor; on CPU the norm takes no _foreach_norm (sum_of_squares says why)."""
    calls = []
    for name in ("_foreach_norm", "_foreach_mul_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    model = _model()
    grads = _grads(model)
    want = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt().item()
    max_norm = want / 3  # clipping active: every gradient scaled by ~1/3
    norm = clip_gradients(model, max_norm, tp_rank=0, group=None)
    # Measured: rel 0.0 here (bound: a few fp32 roundings, the norm squared again vs the squares summed)
    assert norm == pytest.approx(want, rel=1e-6)
    coef = max_norm / (norm + 1e-6)
    assert (
        max(((p.grad - g * coef).abs().max() / g.abs().max()).item() for p, g in zip(model.parameters(), grads)) <= REL
    )  # measured 5e-8
    assert calls == ["_foreach_mul_"]


def test_sum_of_squares_is_as_accurate_as_a_pairwise_sum():
    """On tensors of the parity model's sizes (its 4096 x 64 embedding), and on one longer than a SQUARES_CHUNK, the
    squares' sum is within 1e-7 of fp64's, as pow().sum() (pairwise, measured 2e-8); CPU's fp32 norm kernel errs by
    1e-6, which moved the parity matrix's grad norms by 5e-6 (its bound is 1e-5)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4096 * 64, generator=gen) * 1e-3, torch.randn(688 * 256, generator=gen)]
    tensors.append(torch.randn(SQUARES_CHUNK * 2 + 5, generator=gen))
    for t in tensors:
        want = t.double().pow(2).sum().item()
        assert abs(sum_of_squares([t]).item() - want) / want < 1e-7
