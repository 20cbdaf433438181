"""Hugging Face folders and models the converter tests start from, and the engine's view of them: a random
model per family (with biases and norms set off their defaults), a Llama folder of the checkpoint tests' shape
(hf_source), the engine's logits at a layout, and its training."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from engine.config import load
from engine.parallel.autograd.comm import gather_from_parallel
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.checkpoint.runs import SMALL

SHAPE = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, rope_theta=1e6, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None, head_dim=16),
    # head_dim 24 != hidden / heads = 16: q is 96 wide on hidden 64; per-head q/k norms, tied embeddings
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=24, rope_theta=1e6, tie_word_embeddings=True),
}


SEQ = 48  # > original_max_position_embeddings (16): the llama3 scaling changes every low-frequency pair


def ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 4096, (2, seq), generator=torch.Generator().manual_seed(0))


def hf_model(family: str, families: dict | None = None) -> transformers.PreTrainedModel:
    """A random model of the family (its config from ``families``, default FAMILIES) with random biases and norm
    weights (HF initialises them to 0 and 1, which would hide a bias that is dropped or a norm that is misplaced)."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config((families or FAMILIES)[family]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model


def layout_logits(argv: list[str], tokens: torch.Tensor) -> torch.Tensor | None:
    """Full (b, s, V) logits of the engine model that ``argv`` resumes, at its layout: the first stage's hidden
    states are sent down the pipeline, the last stage gathers the vocab shards. Returned on global rank
    world-1's stage (the last), None elsewhere."""
    cfg = load(argv)
    ctx = ParallelContext.from_config(cfg)
    model = Trainer(cfg, ctx).model.eval()
    shape = (*tokens.shape, cfg.model.hidden_size)
    with torch.no_grad():
        x = tokens if ctx.is_first_stage else torch.empty(shape)
        if not ctx.is_first_stage:
            dist.recv(x, src=ctx.prev_stage_rank)
        out = model(x)
        if not ctx.is_last_stage:
            dist.send(out.contiguous(), dst=ctx.next_stage_rank)
            return None
        return gather_from_parallel(out, ctx.tp_group)


def train(argv: list[str]) -> list[float]:
    cfg = load(argv)
    return [r["loss"] for r in Trainer(cfg, ParallelContext.from_config(cfg)).fit()]


def layout_phase(argv: list[str], ckpt: Path, init_from: list[list[str]] = ()) -> dict:
    """Rank function: logits at the layout of argv, then 5 training steps saved to ``ckpt``; then 5 steps of
    each ``init_from`` argv (runs started straight from the HF folder)."""
    logits = layout_logits(argv, ids())
    return {
        "logits": logits,
        "loss": train([*argv, "--checkpoint.dir", str(ckpt)]),
        "init_from": [train(a) for a in init_from],
    }


TIED = [*SMALL, "--model.tie_embeddings", "true", "--train.steps", "3"]


def hf_source(folder: Path) -> None:
    """A folder written by transformers itself: a random LlamaForCausalLM of TIED's shape and the bundled
    tokenizer. (The pytest process runs torch single-threaded (conftest.py), so this is safe before forking.)"""
    import transformers

    from engine.data.dataset import load_tokenizer
    from engine.hf import convert as hf

    torch.manual_seed(1)
    transformers.LlamaForCausalLM(hf.hf_config(load(TIED).model)).save_pretrained(str(folder))
    load_tokenizer("").save_pretrained(str(folder))
