"""What the bad-step tests share: the dp modes they run (MODES) and every parameter gathered whole (snapshot)."""

from __future__ import annotations

import torch


def snapshot(trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP: gather the dp shards
        out[name] = p.detach().clone()
    return out


MODES = {
    "ddp": [],
    "fsdp": ["--parallel.dp_mode", "fsdp"],
    "zero2": ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "2"],
}
