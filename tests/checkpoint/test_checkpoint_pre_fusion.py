"""Checkpoints written before q/k/v and gate/up were fused load into the fused model, at other tp sizes.

The fixture ``tests/fixtures/pre_fusion_checkpoint`` was saved at tp 2 by commit c38bd66's code (separate q_proj,
k_proj, v_proj, gate_proj, up_proj; how: tests/fixtures/make_pre_fusion_checkpoint.py): a Qwen2-shaped model
(q/k/v biases, GQA 8/4 heads) after 2 AdamW steps, with the logits it gave. Resumed through the checkpointer at
tp 1 and tp 4 (both reshard the tp-2 pieces), the fused model must:
- give the saved logits (fp32, max|a - b| / max|b| <= 1e-5; measured ~1e-7, rounding of another tp);
- hold exactly the saved weights and both Adam moments: every part of every fused parameter equals the tp block
  of the tensor the checkpoint stores under its Hugging Face name, and every stored tensor is held;
- resume at the saved step and data position, with Adam's step count.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.format import Reader, read_index
from engine.checkpoint.parts import CheckpointParts
from engine.model import transformer as model_lib
from engine.model.fused import by_hf_name
from engine.model.init import materialize
from engine.optim import build_optimizer
from engine.parallel.dp.state import TorchState
from engine.parallel.layout.context import ParallelContext
from engine.parallel.tp.layers import apply_tensor_parallel
from tests.dist import run_ranks
from tests.fixtures.make_pre_fusion_checkpoint import config, gathered_logits

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pre_fusion_checkpoint"
REL = 1e-5


def load_rank(path: str, tp: int) -> dict:
    """Rank function: a fresh fused model at ``tp`` (other initial weights: seed 99) resumed from ``path``."""
    cfg = config()
    cfg.parallel.tp, cfg.train.seed, cfg.checkpoint.resume = tp, 99, path
    cfg.train.out_dir = str(Path(path).parent / "out")  # the checkpointer claims it (default: runs/tiny of the cwd)
    ctx = ParallelContext.from_config(cfg)
    model = materialize(
        apply_tensor_parallel(model_lib.build(cfg.model), ctx.tp_group), ctx.device, cfg.train.seed, cfg.model.init_std
    )
    optimizer = build_optimizer(model, cfg.train)
    parts = CheckpointParts(model, lambda: TorchState(model, optimizer, ctx, fsdp=False), cfg, ctx)
    position = Checkpointer(cfg, ctx).resume(parts)
    step = Path(path) / (Path(path) / "latest").read_text().strip()
    reader = Reader(step, read_index(step))
    mismatched, held = [], set()
    for state in ("param", "exp_avg", "exp_avg_sq"):
        tensors = {
            n: (p if state == "param" else optimizer.state[p][state]).detach() for n, p in model.named_parameters()
        }
        for name, (value, module, attr) in by_hf_name(model, tensors).items():
            want = reader.full(name, state)
            dim = getattr(module, "tp_dims", {}).get(attr) if tp > 1 else None
            want = want if dim is None else want.chunk(tp, dim)[ctx.tp_rank]
            held.add(name)
            if not torch.equal(value, want):
                mismatched.append(f"{name} {state}")
    adam_steps = {float(s["step"]) for s in optimizer.state.values()}
    return {
        "logits": gathered_logits(model, ctx),
        "position": (position.step, position.consumed_samples),
        "adam_steps": adam_steps,
        "mismatched": mismatched,
        "held": held,
        "stored": set(reader.params),
    }


@pytest.mark.parametrize("tp", [1, 4])
def test_pre_fusion_checkpoint_loads_at_another_tp(tmp_path, tp):
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, path)  # the run must not touch the fixture
    want = load_file(str(FIXTURE / "logits.safetensors"))["logits"]
    for rank, got in enumerate(run_ranks(load_rank, tp, str(path), tp)):
        rel = ((got["logits"] - want).abs().max() / want.abs().max()).item()
        assert rel <= REL, f"rank {rank}: logits differ from the pre-fusion model's by {rel:.2e}"
        assert not got["mismatched"], f"rank {rank}: not the saved values: {got['mismatched']}"
        assert got["held"] == got["stored"] and any("q_proj" in n for n in got["held"])
        assert got["position"] == (2, 8) and got["adam_steps"] == {2.0}
