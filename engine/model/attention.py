"""Which scaled-dot-product-attention kernel a run takes, per (device, dtype, mask, GQA), and the call that takes it.

Attention is softmax(q k^T / sqrt(d) + M) v (Vaswani et al. 2017). The math kernel materialises the (b, nh, s, s)
scores; the fused kernels (FlashAttention-2, Dao 2023; the memory-efficient kernel, Rabe & Staats 2021, as in
xFormers) stream over key blocks and save only q, k, v, the output and the per-row log-sum-exp for backward.
torch 2.13's SDPA picks the kernel by these rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and
sdp_utils_cpp.cpp), which ``attention_path`` restates so that the planner (engine/planning/activations.py) counts
the bytes of the kernel that actually runs:
  CUDA flash       fp16/bf16 only, no attn_mask, head_dim <= 256; grouped-query attention natively (enable_gqa)
  CUDA efficient   fp32/fp16/bf16, takes attn_mask (a bool mask becomes an additive mask in q's dtype, last dim
                   padded to a multiple of 16, saved for backward); head_dim % 8 (16-bit) or % 4 (fp32); no GQA in
                   2.13 (its backward returns k/v gradients with q's head count), so k/v are repeated to q's heads
                   here: without that, fp32 GQA and every document-masked run fell back to math
  CUDA math        everything else: the (b, nh, s, s) softmax is saved, k/v repeated
  CPU flash        fp32/bf16, masks and GQA natively (torch._fused_sdp_choice picks it for all of this engine's
                   calls); a bool mask is converted to q's dtype and saved, (b, 1, s, s)
  other devices    math is assumed
On sm90 cuDNN attention may take the flash path's place (same saved tensors: q, k, v, output, log-sum-exp).
FlexAttention with a document block mask is left out: in eager mode (and on CPU) it runs an unfused reference that
materialises the scores, and it needs torch.compile to be O(s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.docmask import block_causal_mask

FLASH, EFFICIENT, EFFICIENT_REPEAT_KV = "flash", "efficient", "efficient_repeat_kv"
CPU_FLASH, MATH = "cpu_flash", "math"
REPEATS_KV = (EFFICIENT_REPEAT_KV, MATH)  # k/v saved with q's head count


def attention_path(device_type: str, dtype: torch.dtype, has_doc_mask: bool, gqa: bool, head_dim: int) -> str:
    """The kernel SDPA runs for one call: ``dtype`` is what SDPA computes in (autocast's dtype under autocast),
    ``gqa`` whether k/v have fewer heads than q. Pure, so CUDA cases are decided (and tested) without a GPU."""
    if device_type == "cpu":
        return CPU_FLASH
    if device_type != "cuda":
        return MATH
    half = dtype in (torch.float16, torch.bfloat16)
    if half and not has_doc_mask and head_dim <= 256:
        return FLASH
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % (8 if half else 4) == 0:
        return EFFICIENT_REPEAT_KV if gqa else EFFICIENT
    return MATH


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for input x: autocast's lower precision where autocast is on for x's device."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, 1, s, s) bool (True: attend) -> (b, 1, s, s) of 0 / -inf in ``dtype``: the form SDPA converts a bool mask
    to on every call (the fused kernels then save that copy), built once per forward so every layer saves the same
    tensor: one (b, s, s) per micro-batch instead of one per layer. Results are bit-equal to the bool mask's."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q (b, nh, s, hd), k and v (b, nkv, s, hd), mask None (causal) or (b, 1, s, s), bool (True: attend) or
    additive in SDPA's compute dtype (``additive_mask``) -> (b, nh, s, hd), through the kernel ``attention_path``
    names."""
    gqa, dtype = q.shape[1] != k.shape[1], compute_dtype(q)
    path = attention_path(q.device.type, dtype, mask is not None, gqa, q.shape[-1])
    if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
        mask = mask.to(dtype)  # a mask built for another dtype: correct, but a copy of its own per layer
    if gqa and path == EFFICIENT_REPEAT_KV:
        # k/v (b, nkv, s, hd) -> (b, nh, s, hd), head i of q reading kv head i // (nh / nkv) as enable_gqa does
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


class AttentionCore:
    """What engine.model.transformer.Attention runs between its projections: ``attend`` over the sequence it holds.
    Replaceable per module (``Attention.core``), so a parallel layout can attend across ranks without distributed
    code in the model (engine/parallel/cp/apply.py). ``mask`` builds, once per forward from the document ids,
    what every layer's call then takes."""

    def mask(self, doc_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """doc_ids None (causal) or (b, s) -> None or the (b, 1, s, s) additive block-causal mask in ``dtype``
        (shared by the layers: one saved copy per micro-batch, ``additive_mask``)."""
        return None if doc_ids is None else additive_mask(block_causal_mask(doc_ids), dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return attend(q, k, v, mask)


DEFAULT_CORE = AttentionCore()
