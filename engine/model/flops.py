"""Model FLOPs per token, device peaks, and MFU.

FLOPs per token of training follow PaLM's MFU definition (Chowdhery et al. 2022, "PaLM", Appendix B):

    6 N + 12 L H Q T        N: parameters in matmuls, L layers, H query heads of size Q (H Q = hidden), T seq len

6N is the forward (2N: one multiply-add per weight per token) plus a backward of twice that (Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", Sec. 2.1). 12 L H Q T is attention's two (T x T)-by-Q matmuls, Q K^T
and A V, per layer: 2 * 2 * H Q T forward per token, times 3 with the backward; it is what Narayanan et al. 2021
("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", appendix) count as
72 B s l h^2 (... + s / (6h)) -> 12 s l h per token without recomputation. We count the full T x T score matrix,
as PaLM and Megatron do, not the causal half a flash kernel actually computes, so MFU is comparable with theirs.
N counts the weights that enter a matmul: every linear of the decoder and the LM head (tied or not). The input
embedding is a lookup and the norms and q/k/v biases (Qwen2) are element-wise, so none of them counts (nanoGPT's
estimate_mfu likewise drops the position embedding). FLOPs spent recomputing activations (activation checkpointing) are
not model FLOPs:
``hardware_flops_per_token`` adds them (PaLM's HFU).
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.kinds.recompute import RECOMPUTE
from engine.model.moe import is_moe_layer


def expert_width(m: ModelConfig) -> int:
    """f_e, one expert's SwiGLU width (the dense width f where the family gives none)."""
    return m.moe_intermediate_size or m.intermediate_size


def shared_expert_params(m: ModelConfig) -> int:
    """The shared expert (3 h f_s) and its sigmoid gate (h -> 1); 0 without one."""
    return 3 * m.hidden_size * m.moe_shared_expert_size + m.hidden_size if m.moe_shared_expert_size else 0


def mlp_active_params(m: ModelConfig, index: int) -> int:
    """Matmul weights one token passes through in layer ``index``'s MLP slot (k of the E experts)."""
    h = m.hidden_size
    if not is_moe_layer(m, index):
        return 3 * h * m.intermediate_size
    return m.num_experts * h + m.experts_per_token * 3 * h * expert_width(m) + shared_expert_params(m)


def mean_active_mlp(m: ModelConfig) -> float:
    """Active MLP matmul weights per layer, averaged over the layers (3 h f for a dense model)."""
    return sum(mlp_active_params(m, i) for i in range(m.num_layers)) / m.num_layers


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer that enter a matmul: q, k, v, o and the three SwiGLU projections; with
    mixture-of-experts layers the ACTIVE ones (router, k experts, shared expert) averaged over the layers
    (mean_active_mlp above)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    return 2 * h * cfg.num_heads * hd + 2 * h * cfg.num_kv_heads * hd + round(mean_active_mlp(cfg))


def matmul_params(cfg: ModelConfig) -> int:
    """N of 6N: every layer's matmul weights plus the LM head (V x h)."""
    return cfg.num_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """12 L H Q T: Q K^T and A V (2 FLOPs per multiply-add), forward and backward (x3), full T x T."""
    return 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def recomputed_matmul_params(cfg: ModelConfig) -> int:
    """Weights per layer (averaged over the layers) whose matmuls full recomputation runs again: all but a dense
    block's down_proj. torch.utils.checkpoint stops re-running once it has rebuilt what backward saved, and a dense
    down_proj's output only feeds the residual add, which saves nothing; an MoE layer's expert outputs are weighted
    by the router's probabilities, whose product saves them, so its experts run again whole. Measured with
    FlopCounterMode on the engine's model (tests/model/test_flops.py): tiny re-runs 2 (N - h f) a token and layer."""
    h, layers = cfg.hidden_size, cfg.num_layers
    dense_down = sum(h * cfg.intermediate_size for i in range(layers) if not is_moe_layer(cfg, i))
    return layer_matmul_params(cfg) - round(dense_down / layers)


def stage_flops_per_token(
    cfg: ModelConfig, seq_len: int, layers: int, lm_head: bool, recompute: str | bool = "none"
) -> int:
    """FLOPs per token of ``layers`` decoder layers (and the LM head): 6 N + 12 H Q T per layer, plus one more
    forward of each layer when full activation checkpointing recomputes it (PaLM's hardware FLOPs count 2 N + 4 H Q T;
    torch re-runs all but a dense block's last matmul: recomputed_matmul_params), or of its attention core (4 H Q T)
    under selective recomputation (the matmul outputs are kept).
    ``recompute``: a train.activation_checkpointing mode (True/False: full/none), whose RecomputeSpec says what
    it runs again (engine/kinds/recompute.py)."""
    spec = RECOMPUTE[{True: "full", False: "none"}.get(recompute, recompute)]
    attention = 4 * cfg.num_heads * cfg.head_dim * seq_len  # forward of Q K^T and A V
    matmuls = layer_matmul_params(cfg)
    per_layer = 6 * matmuls + 3 * attention
    per_layer += 2 * recomputed_matmul_params(cfg) * spec.matmul_flops + attention * spec.attention_flops
    return layers * per_layer + (6 * cfg.vocab_size * cfg.hidden_size if lm_head else 0)


def weight_grad_flops_per_token(cfg: ModelConfig, layers: int, lm_head: bool) -> int:
    """FLOPs per token of the weight gradients alone (zero bubble's W; Qi et al. 2023, Sec. 2): dL/dW = x^T dy is
    one multiply-add per weight, 2 N, the other half of a linear's 4 N backward being the input gradient (B)."""
    return 2 * (layers * layer_matmul_params(cfg) + (cfg.vocab_size * cfg.hidden_size if lm_head else 0))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward), PaLM's 6N + 12 L H Q T."""
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, activation_checkpointing: str | bool) -> int:
    """FLOPs the device executes per token: with full-block activation checkpointing each decoder layer's forward
    runs twice, with selective its attention core; the LM head is not recomputed."""
    return stage_flops_per_token(cfg, seq_len, cfg.num_layers, True, activation_checkpointing)


# Dense (no sparsity) datasheet peaks in TFLOP/s: (name patterns, bf16 tensor, tf32 tensor, fp32 non-tensor).
# The first row whose patterns all occur in the lower-cased torch.cuda.get_device_name() wins, so a more specific
# name comes first ("h100 nvl" before "h100"). None: the device has no such unit or the figure is not known here.
# Sources: NVIDIA's H100/H200/A100/L4/L40S/A10 datasheets (their tensor figures halved where they quote
# sparsity), AMD's MI300X/MI250X pages; the bf16 column agrees with torchtitan's get_peak_flops.
DEVICE_PEAKS: tuple[tuple[tuple[str, ...], float | None, float | None, float | None], ...] = (
    (("gb200",), 2500.0, None, None),
    (("b200",), 2250.0, None, None),
    (("h200", "nvl"), 836.0, 417.5, 60.0),
    (("h200",), 989.0, 494.7, 67.0),  # H200 SXM: same compute as H100 SXM, more and faster memory
    (("h100", "nvl"), 835.0, 417.5, 60.0),
    (("h100", "pcie"), 756.0, 378.0, 51.0),
    (("h100",), 989.0, 494.7, 67.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (("h800",), 756.0, 378.0, 51.0),
    (("a100",), 312.0, 156.0, 19.5),  # SXM and PCIe alike
    (("a800",), 312.0, 156.0, 19.5),
    (("l40s",), 362.0, 183.0, 91.6),
    (("l40",), 181.0, 90.5, 90.5),
    (("l4",), 121.0, 60.0, 30.3),
    (("a10",), 125.0, 62.5, 31.2),
    (("v100",), None, None, 15.7),
    (("mi300x",), 1307.4, 653.7, 163.4),
    (("mi250x",), 383.0, None, 47.9),
    (("4090",), 165.2, 82.6, 82.6),
    (("3090",), 71.0, 35.6, 35.6),
)
_COLUMN = {"bf16": 1, "tf32": 2, "fp32": 3}


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Datasheet peak TFLOP/s of ``device_name`` (as torch.cuda.get_device_name gives it) for matmuls in ``dtype``
    (bf16, tf32 or fp32); None for an unknown device (a CPU, say): no MFU rather than a made-up one."""
    if dtype not in _COLUMN:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_COLUMN)}")
    name = device_name.lower()
    for patterns, *peaks in DEVICE_PEAKS:
        if all(p in name for p in patterns):
            return peaks[_COLUMN[dtype] - 1]
    return None


def device_peak_tflops(device, train_dtype: str, override: float = 0.0) -> float | None:
    """The peak for this run: ``override`` when > 0 (a config value), else the table's entry for the CUDA device
    in the dtype its matmuls run in (fp32 matmuls use TF32 units when torch.backends.cuda.matmul.allow_tf32)."""
    import torch

    if override > 0:
        return override
    if getattr(device, "type", device) != "cuda":
        return None
    dtype = train_dtype
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    return peak_tflops(torch.cuda.get_device_name(device), dtype)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak, with ``peak`` in TFLOP/s of one device and
    ``tokens_per_s`` per device (divide a global rate by the world size). None without a known peak."""
    if not peak or peak <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak * 1e12)
