"""The bytes autograd saves for one micro-batch against the planner's activation ledger (saved_and_planned), shared by
the planner's tests and Qwen3's."""

from __future__ import annotations

import torch

from engine.config import load
from engine.metrics.memory import SavedActivations
from engine.model import transformer as model_lib
from engine.parallel.tp.layers import vocab_parallel_cross_entropy
from engine.planning import activations as acts
from engine.planning.planner import with_layout

# The dp modes that compute on bf16 weights under train.dtype=bf16: fsdp's MixedPrecisionPolicy(param_dtype=bf16)
# (engine/parallel/dp/fsdp.py) and DeepSpeed's bf16, which casts the module; ddp runs autocast over fp32 weights.
BF16_WEIGHTS = ("fsdp", "zero")


def saved_and_planned(argv: list[str], dtype: str, dp_mode: str) -> tuple[int, float]:
    """(bytes autograd saves for one micro-batch of argv's model through the loss, the ledger's micro_batch_bytes)."""
    cfg = with_layout(load(argv), dtype=dtype, dp_mode=dp_mode, zero_stage=1 if dp_mode == "zero" else 0)
    model = model_lib.build(cfg.model, device="cpu")
    if dtype == "bf16" and dp_mode in BF16_WEIGHTS:  # stated here, not asked of the spec the ledger reads
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    tracker = SavedActivations(model)
    with tracker.hooks(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
        vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], None)
    return tracker.peak, acts.micro_batch_bytes(cfg, 1, 1, 0, cfg.model.num_layers)
