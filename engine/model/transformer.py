"""A plain Llama-family decoder (Touvron et al. 2023): RMSNorm, RoPE, grouped-query attention, SwiGLU.

No distributed code lives here: tensor parallelism swaps the linear/embedding modules (engine/parallel/tp/layers.py)
and pipeline parallelism drops layers, so every module reads its local head count from its weights, ``layers`` is
a ModuleDict keyed by the global layer index, and ``embed_tokens``/``norm``/``lm_head`` may be None on a stage.
q/k/v and gate/up run as one GEMM each (``qkv_proj``, ``gate_up_proj``: engine/model/fused.py); ``state_dict`` and
``load_state_dict`` speak the names of Hugging Face ``LlamaForCausalLM`` (``model.layers.3.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kinds.families import FAMILIES
from engine.model.attention import DEFAULT_CORE, compute_dtype
from engine.model.fused import FusedLinear, hf_state_dict_hooks, split_output
from engine.model.lean_ops import RMSNormFunction, swiglu
from engine.model.moe import MoE, is_moe_layer
from engine.model.recompute_run import run_block
from engine.model.rope import rope_cos_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019), computed in fp32 as HF Llama does; autograd keeps
    only x and the (..., 1) fp32 rstd (engine/model/lean_ops.py)."""
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """rms_norm with a learned weight (h,)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, hd) rotated by position: x*cos + rotate_half(x)*sin."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal GQA self-attention through torch SDPA on a fused kernel (flash / memory-efficient; the path per
    device, dtype and mask is engine/model/attention.py's, which the planner counts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        parts = {"q_proj": cfg.num_heads * hd, "k_proj": cfg.num_kv_heads * hd, "v_proj": cfg.num_kv_heads * hd}
        self.qkv_proj = FusedLinear(h, parts, bias=cfg.attention_bias)  # Qwen2: q/k/v biases, none on o_proj
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        # softmax(q k^T / sqrt(d) + M) v on the tokens this module holds; context parallelism swaps in a core that
        # attends across the cp group (engine/parallel/cp/apply.py). Not a submodule: it holds no parameters.
        self.core = DEFAULT_CORE
        # q/k RMSNorms (FamilySpec.qk_norm): OLMoE's over the whole projection, weights (nh hd,) / (nkv hd,);
        # Qwen3's per head, one (hd,) weight each shared by all heads, applied before RoPE as transformers does
        kind = FAMILIES[cfg.family].qk_norm
        self.qk_norm_per_head = kind == "head"
        q_width, k_width = (hd, hd) if self.qk_norm_per_head else (cfg.num_heads * hd, cfg.num_kv_heads * hd)
        self.q_norm = RMSNorm(q_width, cfg.norm_eps) if kind else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps) if kind else None
        hf_state_dict_hooks(self)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """mask: what ``self.core.mask`` built: None (causal) or, by default, a (b, 1, s, s) block-causal mask of
        packed documents, bool (True: attend) or additive (0 / -inf, engine/model/attention.py additive_mask)."""
        # Head counts come from the (possibly tensor-parallel) projection: local heads = heads / tp. The length
        # too: under sequence parallelism x is (b, s/tp, h) and the projection gathers the whole sequence.
        qkv = self.qkv_proj(x)  # (b, s, (nh + 2 nkv) hd/tp)
        b, s = qkv.shape[:2]
        q, k, v = split_output(self.qkv_proj, qkv)
        if self.q_norm is not None and not self.qk_norm_per_head:  # OLMoE: over (b, s, nh hd/tp)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))  # (b, s, heads/tp, hd)
        if self.qk_norm_per_head:  # Qwen3: each head's (hd,) vector normalised, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # q (b, nh/tp, s, hd); k, v (b, nkv/tp, s, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA saves v for backward: a view would keep the whole fused (b, s, (nh + 2 nkv) hd/tp) output alive;
        # its own copy (nkv hd/tp) keeps the saved bytes those of separate projections.
        v = v.contiguous()
        o = self.core(q, k, v, mask)  # default: the kernel for (device, dtype, mask, GQA), engine/model/attention.py
        o = o.transpose(1, 2).reshape(b, s, -1)  # (b, s, nh*hd/tp)
        return self.o_proj(o)  # (b, s, h)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, ffn: int | None = None):
        super().__init__()
        ffn = ffn or cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate_proj": ffn, "up_proj": ffn}, bias=False)
        self.down_proj = nn.Linear(ffn, cfg.hidden_size, bias=False)
        hf_state_dict_hooks(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = split_output(self.gate_up_proj, self.gate_up_proj(x))  # (b, s, ffn/tp) each
        return self.down_proj(swiglu(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). ``recompute``: none | full | selective
    activation checkpointing of the block (engine/model/recompute.py, recompute_run.py). The MLP slot holds the MoE
    block in the layers model.moe_layers names (engine/model/moe.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        shared = MLP(cfg, cfg.moe_shared_expert_size) if cfg.moe_shared_expert_size else None
        self.mlp = MoE(cfg, shared) if is_moe_layer(cfg, index) else MLP(cfg)
        self.recompute = "none"

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return run_block(self, self.recompute, x, cos, sin, mask)

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers (global indices as keys) and final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # Sequence parallelism (set by engine/parallel/tp/layers.py) runs the layers on 1/sequence_shards of the tokens
        self.sequence_shards = 1

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: token ids (b, s) on the first stage, else hidden states (b, s, h). position_ids (b, s): RoPE
        positions (default 0..s-1); doc_ids (b, s): document index of each token, attention stays within a
        document (default: one document). Returns (b, s, h); (b, s/sequence_shards, h) in and out under sequence
        parallelism, where RoPE and the mask still cover the whole sequence (attention sees it gathered)."""
        return decode(
            self.cfg, self.embed_tokens, self.layers.values(), self.norm, x, position_ids, doc_ids, self.sequence_shards
        )


def decode(
    cfg: ModelConfig,
    embed: nn.Module | None,
    layers,
    norm: nn.Module | None,
    x: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    sequence_shards: int = 1,
) -> torch.Tensor:
    """The decoder's forward over any run of its parts: embed (if given) the token ids x (b, s), else take hidden
    states x (b, s, h); run ``layers`` in order; apply ``norm`` (if given). LlamaModel runs all of its parts; a
    pipeline chunk runs its own (engine/parallel/pp/virtual.py). Returns (b, s, h), or (b, s/sequence_shards, h)
    under sequence parallelism, whose default positions still cover the whole sequence."""
    h = embed(x) if embed is not None else x
    if position_ids is None:
        position_ids = torch.arange(h.shape[1] * sequence_shards, device=h.device)
    cos, sin = rope_cos_sin(cfg, position_ids, compute_dtype(h))
    # Built once, shared by the layers (by default a (b, 1, s, s) additive mask in SDPA's dtype: each layer would
    # save its own copy of a bool one), by the layers' attention core, which may cover more than these tokens
    layers = list(layers)
    core = layers[0].self_attn.core if layers else DEFAULT_CORE
    mask = core.mask(doc_ids, compute_dtype(h))
    for layer in layers:
        h = layer(h, cos, sin, mask)
    return norm(h) if norm is not None else h


class Llama(nn.Module):
    """Decoder plus LM head; the module tree of HF ``LlamaForCausalLM`` with q/k/v and gate/up fused, and its
    state_dict names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head: nn.Module | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns logits (b, s, vocab/tp) on the last stage, hidden states (b, s, h) elsewhere."""
        h = self.model(x, position_ids, doc_ids)
        return self.lm_head(h) if self.lm_head is not None else h


def build(cfg: ModelConfig, device: torch.device | str = "meta") -> Llama:
    """Build the model without allocating storage (meta device by default); see engine.model.init.materialize."""
    with torch.device(device):
        return Llama(cfg)


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embeddings and "embed_tokens" in name):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
