"""Activation memory of one micro-batch of THIS engine's Llama (engine/model/transformer.py), counted tensor by tensor.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1) give
s b h (34 + 5 a s / h) bytes per layer for GPT-3 in 16-bit with dropout and a stored s x s score matrix. This
engine differs in every term (side by side: docs/design-notes.md, "Activation memory per layer"), so the ledger
below lists what autograd saves for backward in each op of DecoderLayer.forward, per token (b s tokens), for
tp-sharded widths h/t, qd/t = heads*head_dim/t (h unless model.head_dim says otherwise), kvd/t = kv_heads*head_dim/t,
f/t and a/t heads:
  RMSNorm (x2)  x as given and the fp32 rstd (engine/model/lean_ops.py), y = weight*x_n (the next linears'
                input)                                                     -> x, y: 2h values; rstd: 1 fp32
  attention     a fused SDPA kernel (flash/memory-efficient; no s x s matrix) saves rotated q, rotated k, v, its
                output (which is o_proj's input) and the log-sum-exp (a/t fp32 values); RoPE saves only cos/sin
                                                                           -> 2qd/t + 2 kvd/t (+ a/t fp32)
                plus what the run's kernel path holds beyond that (``attention_bytes_per_token``, the path from
                engine/model/attention.py): k/v repeated to a/t heads, or on the math path the (b, a/t, s, s)
                softmax; and once per micro-batch the document mask, (b, 1, s, s) in the kernel's dtype
  SwiGLU MLP    gate and up (engine/model/lean_ops.py swiglu recomputes silu(gate) in backward), their product
                (down_proj's input)                                        -> 3 f/t
Dtypes (measured on CPU with torch.autograd.graph.saved_tensors_hooks; tests/planning/test_planner.py):
  fp32      everything fp32:  16h + 8 + (8qd + 8kvd + 4a + 12f)/t bytes per token
  autocast  bf16 matmuls on fp32 weights (train.dtype bf16 with ddp): norms stay fp32 (x: 8h + 8), each
            linear saves its own bf16 cast of y (the fused qkv and gate_up: 2 x 2h; 5 x 2h before the fusion),
            attention and MLP tensors are bf16: 12h + 8 + (4qd + 4kvd + 4a + 6f)/t, plus the bf16 copy of every
            weight autocast makes for each forward (2 bytes x the layer's matmul parameters, per micro-batch, since
            the cache dies with the autocast region)
  bf16      bf16 weights (fsdp's bf16 compute copy; DeepSpeed bf16): x and y are bf16 (2h each; the norm's fp32
            math is redone in backward): 8h + 8 + (4qd + 4kvd + 4a + 6f)/t (before issue 46: 16h + 8 + ... + 8f/t)
With full activation checkpointing only each layer's input (the residual stream) is kept per micro-batch, and
one layer's activations are rebuilt at a time during backward (``transient_bytes``). Selective checkpointing
(engine/model/recompute.py) keeps the input and the matmul outputs: qkv ((qd + 2 kvd)/t), o_proj (h, the
row-parallel output; h/t under sequence parallelism), gate_up (2f/t), down (h; h/t), in the matmul dtype (fp32,
or bf16 under autocast and bf16), and rebuilds the rest of one layer at a time; autocast's weight copies are
recomputed too.
Sequence parallelism (parallel.sequence_parallel; Korthikanti et al. Sec. 4.2.2, their sbh(34/t + 5as/(ht))):
the norms, the residual stream and the layer input run on s/t tokens, so every term above that is not already /t becomes
/t (``sequence_share``). The column-parallel layers keep only their local (s/t) input and gather it again in backward
(engine/parallel/autograd/comm.py; engine/parallel/autograd/weight_grad.py under zero bubble), so under autocast no bf16
cast of y is saved but y itself is (fp32, 2 x 4h: the 6h of casts become 8h), and only the row-parallel weights' bf16
copies are saved. Under selective recomputation the row-parallel linear and its reduce-scatter are one operator
(engine/parallel/autograd/comm.py sequence_reduced_linear) whose (b, s/t, h) output is kept, not the (b, s, h)
partial sums (under zero bubble too: its backward defers the weight gradient). Unchanged: the token ids, the logits
and the loss's per-token values.
Context parallelism (parallel.cp): a rank holds b s / cp tokens (``local_tokens``), so every per-token term counts
those; the document mask stays whole ((b, 1, s, s) on every cp rank; the ring keeps none: it masks each K/V block
from the (b, s) document ids). Both keep o_proj's own copy of the attention output (a hd/t values a token).
all_to_all (engine/parallel/cp/ulysses.py) runs attention on a/(t cp) whole heads of s tokens, the same saved
bytes as a/t heads of s/cp tokens, plus 4 (s,) int64 reorder indices a layer; the ring saves q, k, v (n_kv heads,
never repeated), its output and the fp32 lse (engine/parallel/cp/ring.py) (tests/parallel/cp/test_cp.py).
"""

from __future__ import annotations

import torch

from engine.config import Config
from engine.kinds import dp_modes
from engine.kinds.cp_modes import CP_MODES
from engine.kinds.families import FAMILIES
from engine.kinds.recompute import RECOMPUTE
from engine.model.attention import EFFICIENT, EFFICIENT_REPEAT_KV, MATH, REPEATS_KV, attention_path
from engine.parallel.tp.cross_entropy import CHUNK_ELEMENTS
from engine.planning.moe import (
    expert_grad_buffer_bytes,
    mean_over_layers,
    mlp_params,
    routing_bytes_per_token,
    token_ffn_width,
)


def mode(cfg: Config) -> str:
    """Which ledger applies: fp32, autocast or bf16 (see the module docstring; bf16 where the dp mode computes on
    bf16 weights, DpModeSpec.bf16_weights: fsdp's compute copy, DeepSpeed's bf16)."""
    if cfg.train.dtype != "bf16":
        return "fp32"
    return "bf16" if dp_modes.spec(cfg).bf16_weights else "autocast"


def sequence_share(cfg: Config, tp: int) -> int:
    """What divides the replicated activations (norms, residual stream): tp under sequence parallelism, else 1."""
    return tp if cfg.parallel.sequence_parallel and tp > 1 else 1


def residual_bytes(cfg: Config) -> int:
    """Bytes per value of the residual stream (the stage input/output dtype)."""
    return 2 if mode(cfg) == "bf16" else 4


def ffn_width(cfg: Config) -> float:
    """The SwiGLU width of a token's activations, averaged over the layers (engine/planning/moe.py token_ffn_width:
    under expert parallelism the busiest rank's)."""
    return mean_over_layers(cfg.model, lambda m, i: token_ffn_width(m, i, cfg.parallel.ep))


def checkpointed_layer_bytes_per_token(cfg: Config, tp: int) -> float:
    """Bytes per token one layer keeps under activation checkpointing: its input, plus the matmul outputs with
    selective recomputation."""
    m = cfg.model
    h, qd, kvd, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, ffn_width(cfg)
    sp = sequence_share(cfg, tp)
    kept = h * residual_bytes(cfg) / sp
    # selective: qkv_proj's (qd + 2 kvd)/t and gate_up's 2f/t, o_proj's and down's h: under sequence parallelism their
    # reduce-scattered h/t (engine/parallel/autograd/comm.py sequence_reduced_linear, zero bubble's deferred W too)
    if RECOMPUTE[cfg.train.activation_checkpointing].keeps_matmul_outputs:
        kept += logit_bytes(cfg) * (2 * h / sp + (qd + 2 * kvd + 2 * f) / tp)
    return kept


def device_type(cfg: Config) -> str:
    """The device a run of cfg computes on, as engine/parallel/layout/context.py picks it (nccl: cuda, gloo: cpu,
    auto: cuda where available); unlike it, planning a CUDA run on a machine without one is allowed."""
    backend = cfg.parallel.backend
    return "cuda" if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()) else "cpu"


def planned_attention_path(cfg: Config) -> str:
    """The attention kernel every layer of a cfg run takes (engine/model/attention.py attention_path)."""
    m = cfg.model
    dtype = torch.float32 if mode(cfg) == "fp32" else torch.bfloat16  # autocast: SDPA runs in bf16
    return attention_path(device_type(cfg), dtype, cfg.data.document_mask, m.num_heads != m.num_kv_heads, m.head_dim)


def attention_bytes_per_token(cfg: Config, tp: int) -> float:
    """Saved bytes per token of one layer's attention beyond the fused kernels' q, k, v, output and log-sum-exp
    (counted in layer_bytes_per_token), in the kernel's dtype: k and v repeated from kvd/t to a*hd/t; on the math
    path the softmax (b, a/t, s, s) in place of the log-sum-exp; on the CUDA efficient kernel, where s is not a
    multiple of 16, its own copy of the document mask padded to 16 (pad16(s) values a token; else the layers
    share one: ``document_mask_bytes``)."""
    m, s = cfg.model, cfg.train.seq_len
    a, qd, kvd = m.num_heads, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    width, path = logit_bytes(cfg), planned_attention_path(cfg)
    extra = 2 * (qd - kvd) / tp * width if path in REPEATS_KV else 0.0
    if cfg.parallel.cp > 1:  # o_proj's input is a copy (ring: the (b, a/t, s/cp, hd) output made contiguous
        # as (b, s/cp, a hd/t); all_to_all: the output all-to-all's result) beside the output the core keeps
        extra += qd / tp * width
    if cp_mode(cfg) and cp_mode(cfg).saves_own_attention:  # ring.py saves its own q, k, v (n_kv heads), output
        return extra  # and lse whatever the kernel path
    if path == MATH:
        return extra + a / tp * (s * width - 4)
    if cfg.data.document_mask and path in (EFFICIENT, EFFICIENT_REPEAT_KV) and s % 16:
        extra += -(-s // 16) * 16 * width
    return extra


def cp_mode(cfg: Config):
    """The CpModeSpec of a run's context parallelism (engine/kinds/cp_modes.py); None at cp = 1, where no mode
    applies."""
    return CP_MODES[cfg.parallel.cp_mode] if cfg.parallel.cp > 1 else None


def recomputes(cfg: Config) -> bool:
    """Whether activation checkpointing re-runs the blocks (RecomputeSpec.recomputes): the checkpointed ledger."""
    return RECOMPUTE[cfg.train.activation_checkpointing].recomputes


def document_mask_bytes(cfg: Config, num_layers: int) -> float:
    """The (b, 1, s, s) additive document mask decode() builds once per micro-batch in the kernel's dtype
    (engine/model/attention.py additive_mask), kept while the fused kernels save it (not when the CUDA efficient
    kernel pads a copy of its own), or activation checkpointing keeps it as every block's input."""
    t, path = cfg.train, planned_attention_path(cfg)
    own_copies = path in (EFFICIENT, EFFICIENT_REPEAT_KV) and t.seq_len % 16
    kept = recomputes(cfg) or (path != MATH and not own_copies)
    ring = cp_mode(cfg) and cp_mode(cfg).masks_from_doc_ids  # the ring: masks from the doc ids
    if not cfg.data.document_mask or num_layers == 0 or not kept or ring:
        return 0.0
    return t.micro_batch_size * t.seq_len**2 * logit_bytes(cfg)


def layer_bytes_per_token(cfg: Config, tp: int) -> float:
    """Saved bytes per token of one decoder layer (without autocast's weight copies)."""
    m = cfg.model
    a, f = m.num_heads, ffn_width(cfg)
    qd, kvd = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim  # q and k/v widths: qd need not be h (Qwen3)
    sp, attn = sequence_share(cfg, tp), attention_bytes_per_token(cfg, tp) + qk_norm_bytes_per_token(cfg, tp)
    lb = logit_bytes(cfg)
    # MoE (f: the k experts' width a token has, engine/planning/moe.py): + copies, router logits, indices
    attn += mean_over_layers(m, lambda m, i: routing_bytes_per_token(m, i, logit_bytes(cfg), cfg.parallel.ep))
    # the two norms (``norm_bytes_per_token``; over s/t tokens under sp), q, k, v and the attention output, the MLP's
    # gate and up (engine/model/lean_ops.py swiglu) and their product (down_proj's input)
    return 2 * norm_bytes_per_token(cfg, tp) / sp + (lb * (2 * qd + 2 * kvd + 3 * f) + 4 * a) / tp + attn


def norm_bytes_per_token(cfg: Config, tp: int) -> float:
    """What one RMSNorm (engine/model/transformer.py rms_norm) and the linear it feeds save per token it holds: its
    input as given (the residual stream's dtype) and the fp32 rstd, which is all the norm saves; its output y,
    which the next linear saves: y in fp32 and bf16, autocast's bf16 cast of y, or under sequence parallelism y
    itself (the gathered linear keeps its local fp32 input, engine/parallel/autograd/comm.py)."""
    h = cfg.model.hidden_size
    y = 2 if mode(cfg) == "bf16" or (mode(cfg) == "autocast" and sequence_share(cfg, tp) == 1) else 4
    return (residual_bytes(cfg) + y) * h + 4


def qk_norm_bytes_per_token(cfg: Config, tp: int) -> float:
    """What the q/k RMSNorms save (FamilySpec.qk_norm), per token on one tp rank: their input as given, a view of
    the fused qkv output, whose whole (qd + 2 kvd)/t storage it keeps in the matmul dtype (measured), and the fp32
    rstd (one value per normalised row: (a + a_kv)/t heads (Qwen3), or 2 whole projections (OLMoE)); their output
    is RoPE's input, which saves only cos/sin. OLMoE's norms at tp > 1 (engine/parallel/tp/moe.py
    TensorParallelProjectionNorm, op by op) keep an fp32 x ((qd + kvd)/t values; in fp32 the whole qkv storage
    (qd + 2 kvd)/t) and x_n in the matmul dtype."""
    m = cfg.model
    kind = FAMILIES[m.family].qk_norm
    if kind is None:
        return 0.0
    qk, kvd = (m.num_heads + m.num_kv_heads) * m.head_dim / tp, m.num_kv_heads * m.head_dim / tp
    rows = (m.num_heads + m.num_kv_heads) / tp if kind == "head" else 2
    if kind == "head" or tp == 1:
        return logit_bytes(cfg) * (qk + kvd) + 4 * rows
    return 4 * (qk + (kvd if mode(cfg) == "fp32" else 0)) + logit_bytes(cfg) * qk + 4 * rows


def weight_copy_bytes(cfg: Config, tp: int, num_layers: int, last_stage: bool) -> float:
    """autocast's bf16 copies of the stage's matmul weights, saved for backward once per micro-batch."""
    if mode(cfg) != "autocast":
        return 0.0
    m = cfg.model
    h, hd = m.hidden_size, m.head_dim
    if sequence_share(cfg, tp) > 1:  # only the row-parallel linears' copies: o_proj and down_proj
        return 2.0 * num_layers * (h * m.num_heads * hd + h * m.intermediate_size) / tp
    layer = 2 * h * m.num_heads * hd + 2 * h * m.num_kv_heads * hd + mean_over_layers(m, mlp_params)
    head = m.vocab_size * h if last_stage else 0
    return 2.0 * (num_layers * layer + head) / tp


def head_bytes_per_token(cfg: Config, tp: int) -> float:
    """Last stage: final norm, LM head input, and what the loss saves: the logits (b s, V/t) and per-token values."""
    v = cfg.model.vocab_size
    norm = norm_bytes_per_token(cfg, tp) / sequence_share(cfg, tp)  # the final norm and the LM head's input
    # The chunked loss (engine/parallel/tp/cross_entropy.py) saves the logits in their own dtype (fp32, or bf16 from
    # an autocast or bf16 LM head), the fp32 log-sum-exp, the int64 local targets and two bool masks.
    return norm + logit_bytes(cfg) * v / tp + 14


def logit_bytes(cfg: Config) -> int:
    """Bytes per value of a matmul output (the LM head's and the layers')."""
    return 4 if mode(cfg) == "fp32" else 2


def local_tokens(cfg: Config) -> int:
    """Tokens of one micro-batch a rank holds: b s / cp (context parallelism splits the sequence)."""
    return cfg.train.micro_batch_size * cfg.train.seq_len // cfg.parallel.cp


def micro_batch_bytes(cfg: Config, tp: int, pp: int, stage: int, num_layers: int) -> float:
    """Bytes one micro-batch keeps alive on ``stage`` from its forward to its backward."""
    t = cfg.train
    tokens = local_tokens(cfg)
    last = stage == pp - 1
    per_token = 0.0
    if stage == 0:
        per_token += 8 if tp == 1 else 9  # token ids saved by the embedding (+ the out-of-shard mask at tp > 1)
    if recomputes(cfg):
        per_token += num_layers * checkpointed_layer_bytes_per_token(cfg, tp)
    else:
        per_token += num_layers * layer_bytes_per_token(cfg, tp)
    if last:
        per_token += head_bytes_per_token(cfg, tp)
    # cos and sin tables in the compute dtype, built once per forward: (s, hd), or (b, s, hd) from the document
    # mask's per-row positions
    rope = (
        2
        * (t.micro_batch_size if cfg.data.document_mask else 1)
        * t.seq_len
        // cfg.parallel.cp
        * cfg.model.head_dim
        * logit_bytes(cfg)
    )
    copies = 0.0 if recomputes(cfg) else weight_copy_bytes(cfg, tp, num_layers, last)
    if (cp := cp_mode(cfg)) and not recomputes(cfg):  # all_to_all: per layer its 4 (s,) int64 token-order
        copies += num_layers * cp.reorder_indices * 8 * t.seq_len  # indices, which index_select saves (cp/layout.py)
    return tokens * per_token + rope + copies + document_mask_bytes(cfg, num_layers)


def transient_bytes(cfg: Config, tp: int, last_stage: bool) -> float:
    """Short-lived buffers at the backward's peak, the largest of: on the last stage the logits' gradient ((b s, V/t)
    in their dtype, beside the saved logits) and the loss's fp32 temporaries (two of its chunks from bf16 logits); the
    gradients flowing back through one MLP (about four (b s, f/t) tensors; an MoE layer's also its experts'
    stacked weight gradient, engine/planning/moe.py); with activation checkpointing, one
    layer of one micro-batch rebuilt for its backward."""
    m = cfg.model
    tokens = local_tokens(cfg)
    out = tokens * 4 * ffn_width(cfg) / tp * residual_bytes(cfg) + expert_grad_buffer_bytes(m, cfg.parallel.ep)
    if recomputes(cfg):
        out += tokens * layer_bytes_per_token(cfg, tp) + weight_copy_bytes(cfg, tp, 1, False)
    if last_stage:
        local_v = m.vocab_size / tp
        chunk = min(tokens, max(1, CHUNK_ELEMENTS // int(local_v)))  # tokens per loss chunk
        # the backward's fp32 softmax of a chunk and its fp32 cast from bf16; fp32 logits: none (the softmax is
        # written into the gradient's own rows, engine/parallel/tp/cross_entropy.py)
        temps = 0 if logit_bytes(cfg) == 4 else 2
        out = max(out, tokens * logit_bytes(cfg) * local_v + temps * 4 * chunk * local_v)
    return out
