"""Rotary position embeddings (Su et al. 2021, "RoFormer") and the frequency scalings of HF ``rope_scaling``.

- none: inv_freq_i = theta^(-2i/d).
- linear (Chen et al. 2023, "Extending Context Window ... via Positional Interpolation"): inv_freq / factor.
- llama3 (Llama 3.1, Dubey et al. 2024; transformers' ``_compute_llama3_parameters``): wavelengths longer than
  original_max_position_embeddings / low_freq_factor are stretched by ``factor``, those shorter than
  original / high_freq_factor are kept, and the band in between is interpolated smoothly.
Positions are per token (b, s), so packed documents can each start again at 0 (engine/model/docmask.py).
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """(hd/2,) fp32 angular frequency of each rotated pair, after cfg.rope_scaling."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.int64).float() / hd))
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling != "llama3":
        return inv_freq
    old, low, high = cfg.rope_original_max_position_embeddings, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables in HF Llama's 'rotate half' layout for integer positions (s,) or (b, s): cos and sin of shape
    (s, hd), or (b, 1, s, hd) to broadcast over heads."""
    inv_freq = inv_frequencies(cfg, positions.device)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (..., s, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., s, hd)
    if emb.dim() == 3:
        emb = emb.unsqueeze(1)  # (b, 1, s, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)
