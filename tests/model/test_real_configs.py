"""The shipped configs of real checkpoints (configs/*.yaml) have the published shapes.

Each gives the parameter count of its model card, counted three ways that must agree: our model built on the
meta device, transformers' own class for the family built on the meta device from the config we would export
(engine/hf/families.py), and the planner's per-rank counts summed over stages at tp 1. And launch/plan.py plans
each one on 8 H100s (four in CI, the others marked slow).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from engine.config import load
from engine.hf import families
from engine.model import transformer as model_lib
from engine.planning.planner import stage_params
from tests.cli import ROOT

PUBLISHED = {  # total parameters of the published checkpoints (tied embeddings counted once)
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b-v0.3": 7_248_023_552,
    "smollm2-135m": 134_515_008,
    "mixtral-8x7b": 46_702_792_704,  # model card: 46.7B (experts of every layer counted; 12.9B active)
    "qwen1.5-moe-a2.7b": 14_315_784_192,  # model card: 14.3B
    "olmoe-1b-7b": 6_919_161_856,  # model card: 6.9B
    "qwen3-0.6b": 596_049_920,  # model card: 0.6B (head_dim 128 != hidden 1024 / 16 heads; per-head q/k norms)
    "qwen3-30b-a3b": 30_532_122_624,  # model card: 30.5B (3.3B active)
    "llama-3.1-405b": 405_853_388_800,  # model card: 405B; planned at its scale in tests/planning/test_balance.py
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_count(name):
    cfg = load(["--config", f"configs/{name}.yaml"])
    ours = model_lib.count_params(model_lib.build(cfg.model, device="meta"))
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(families.hf_config(cfg.model))
    counted = sum(p.numel() for p in theirs.parameters())  # parameters() yields a tied weight once
    planned = sum(sum(stage_params(cfg, 1, 2, s)[k] for k in ("layers", "root")) for s in range(2))
    planned -= cfg.model.vocab_size * cfg.model.hidden_size if cfg.model.tie_embeddings else 0  # 2 copies at pp 2
    assert ours == counted == planned == PUBLISHED[name]


def _plan_main():
    spec = importlib.util.spec_from_file_location("plan_cli", ROOT / "launch" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


# plan.py's search on 8 devices takes 5-19 s a config on 2 loaded cores (about 110 s for all): CI plans a dense one,
# Qwen3's head_dim, the smallest and an MoE one (Mixtral's 64-GPU plan is tests/planning/test_plan_ep.py's); the rest
# are slow
PLANNED_IN_CI = ("qwen3-0.6b", "smollm2-135m")  # the others are slow (13-17 s of search each)


@pytest.mark.parametrize(
    "name",
    [n if n in PLANNED_IN_CI else pytest.param(n, marks=pytest.mark.slow) for n in PUBLISHED if n != "llama-3.1-405b"],
)
def test_plan_real_config(name, capsys):
    assert (
        _plan_main()(["--config", f"configs/{name}.yaml", "--world-size", "8", "--device-memory", "80", "--top", "3"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(f"{name}: seq_len") and "valid layouts, " in out and "planned in full" in out
