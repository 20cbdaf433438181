"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM", Sec. 3) and the plan that applies them.

A column-parallel linear splits the output features (weight rows) across the tp group; a row-parallel linear
splits the input features (weight columns) and all-reduces its output. Attention heads and the SwiGLU hidden dim
are split this way, so a block needs one all-reduce forward and one backward per sub-layer: q/k/v and gate/up are
fused linears (engine/model/fused.py), each one column-parallel GEMM behind one ``f``, so a decoder layer runs 2
all-reduces forward (o_proj, down_proj) and 2 backward (in front of qkv_proj, gate_up_proj), where separate q, k,
v, gate and up linears ran 5 backward (tests/parallel/tp/test_tp_collectives.py counts them). The embedding and the
LM head split the vocabulary; the loss is computed on vocab-sharded logits without gathering them
(engine/parallel/tp/cross_entropy.py, re-exported here).

With sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2; ``apply_tensor_parallel(..., sequence_parallel=True)``)
the residual stream between the layers is (b, s/tp, h): a column-parallel layer all-gathers its input along the
sequence (and keeps only the local chunk for backward), a row-parallel layer and the embedding reduce-scatter their
output instead of all-reducing it, and the norms run on s/tp tokens, their weights' gradients summed over tp in
backward. The LM head gathers too, so the logits are (b, s, V/tp) and the loss is unchanged. With ``comm_overlap``
(parallel.tp_comm_overlap) the column-parallel linears' all-gathers and the row-parallel ones' reduce-scatters, and
their backward counterparts, run as rings whose transfers overlap the matmul they feed
(engine/parallel/autograd/collective_matmul.py); zero bubble's deferred column linear keeps the blocking ones
(engine/parallel/layout/checks.py refuses the two together).

Every parallel module records which dim of each parameter is sharded in ``tp_dims`` (name -> dim) together with
``tp_rank``/``tp_size``: engine.model.init uses it to cut each local shard from the same full tensor at every tp.
A fused linear's record applies to each of its parts (``part_blocks``): its local weight is [q_r; k_r; v_r].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.fused import FusedLinear
from engine.model.moe import MoE
from engine.model.transformer import RMSNorm, rms_norm
from engine.parallel.autograd.comm import (
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    reduce_scatter_to_sequence_parallel,
    register_group,
    scatter_to_parallel,
    sequence_gathered_linear,
    sequence_reduced_linear,
)
from engine.parallel.autograd.weight_grad import WeightGradStore, linear_with_deferred_weight
from engine.parallel.tp.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401 (layers.vocab_parallel_cross_entropy: the public name)
from engine.parallel.tp.moe import shard_moe, shard_qk_norms


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows: weight (out/tp, in), bias (out/tp,) split with it (Qwen2's q/k/v).
    Input copied (f), output sharded (b, s, out/tp); with ``sequence_parallel`` the input is (b, s/tp, in), gathered
    (``comm_overlap``: by a ring behind the matmul). ``weight_grad_store``: engine/parallel/autograd/weight_grad.py."""

    weight_grad_store: WeightGradStore | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        gather_output: bool = False,
        bias: bool = False,
        sequence_parallel: bool = False,
        comm_overlap: bool = False,
    ):
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel
        self.tp_rank, self.tp_size = _rank_size(group)
        self.in_features, self.out_features = in_features, out_features
        local = _divide(out_features, self.tp_size, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        self.tp_dims = {"weight": 0, "bias": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.weight_grad_store is not None:  # zero bubble (autograd/weight_grad.py): one
            # Function gathers the sequence and defers W: (b, s/tp, in) -> (b, s, out/tp)
            y = linear_with_deferred_weight(x, self.weight, self.bias, self.weight_grad_store, seq_group=self.group)
        elif self.sequence_parallel:  # (b, s/tp, in) gathered along the sequence inside
            y = sequence_gathered_linear(x, self.weight, self.bias, self.group, self.comm_overlap)  # (b, s, out/tp)
        else:
            x = copy_to_parallel(x, self.group)
            y = linear_with_deferred_weight(x, self.weight, self.bias, self.weight_grad_store)  # (b, s, out/tp)
        return gather_from_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}/{self.tp_size}"


class ColumnParallelFusedLinear(ColumnParallelLinear):
    """A FusedLinear (engine/model/fused.py) split by rows per part: weight (sum(out)/tp, in) = [q_r; k_r; v_r]
    (gate_r, up_r), one GEMM behind one ``f``; output (b, s, sum(out)/tp), which the model splits per part."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        group,
        bias: bool = False,
        sequence_parallel: bool = False,
        comm_overlap: bool = False,
    ):
        super().__init__(
            in_features,
            sum(parts.values()),
            group,
            bias=bias,
            sequence_parallel=sequence_parallel,
            comm_overlap=comm_overlap,
        )
        for name, rows in parts.items():
            _divide(rows, self.tp_size, f"{name} out_features")
        self.parts = dict(parts)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, parts={self.parts}/{self.tp_size}"


class RowParallelLinear(nn.Module):
    """y = x A^T with A split by columns: weight (out, in/tp). Input sharded (b, s, in/tp), output all-reduced (g),
    or with ``sequence_parallel`` reduce-scattered along the sequence to (b, s/tp, out) (``comm_overlap``: by a ring
    behind the matmul). ``weight_grad_store``: see engine/parallel/autograd/weight_grad.py."""

    weight_grad_store: WeightGradStore | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        comm_overlap: bool = False,
    ):
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel
        if sequence_parallel:
            register_group(group)  # the sequence-reduced operator's (below) group, by name
        self.tp_rank, self.tp_size = _rank_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, self.tp_size, "in_features")))
        self.tp_dims = {"weight": 1}
        # set by engine/model/recompute.py under selective recomputation: run the one operator it keeps
        self.in_selective_block = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group)
        if self.sequence_parallel and (self.in_selective_block or self.comm_overlap):
            # one operator, whose (b, s/tp, out) output selective recomputation keeps (zero bubble: its backward
            # defers W through this layer's store); the one that overlaps its reduce-scatter
            layer = None if self.weight_grad_store is None else self
            return sequence_reduced_linear(x, self.weight, self.group, layer, self.comm_overlap)
        y = linear_with_deferred_weight(x, self.weight, None, self.weight_grad_store)  # (b, s, out) partial sums
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(y, self.group)  # (b, s/tp, out)
        return reduce_from_parallel(y, self.group)

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.tp_size}, out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with rows [rank*V/tp, (rank+1)*V/tp) on each rank; other ids give zeros, then all-reduce (g), or
    with ``sequence_parallel`` reduce-scatter along the sequence to (b, s/tp, h)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_rank, self.tp_size = _rank_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _divide(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start, self.vocab_end = self.tp_rank * local, (self.tp_rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        self.tp_dims = {"weight": 0}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (b, s)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (b, s, h) partial
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.group)  # (b, s/tp, h)
        return reduce_from_parallel(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}/{self.tp_size}, {self.embedding_dim}"


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm over this rank's (b, s/tp, h) tokens under sequence parallelism. Its weight is replicated but sees
    only s/tp tokens, so its gradient is summed over tp in backward (``copy_to_parallel``: identity forward,
    all-reduce backward), as Megatron's finalize_model_grads does for sequence-parallel parameters. Inside the
    autograd graph, so every dp mode (ZeRO-2/3 reduce gradients during backward) gets the summed gradient."""

    def __init__(self, dim: int, eps: float, group):
        super().__init__(dim, eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_parallel(self.weight, self.group), self.eps)


# The plan table: which sub-module of a DecoderLayer becomes which parallel layer.
LAYER_PLAN = {
    "self_attn.qkv_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.gate_up_proj": "column",
    "mlp.down_proj": "row",
}


# Under sequence parallelism: the norms of a DecoderLayer (and the decoder's final norm) that run on s/tp tokens.
SEQUENCE_PARALLEL_NORMS = ("input_layernorm", "post_attention_layernorm")


def _parallel_linear(old: nn.Module, style: str, group, sp: bool, overlap: bool) -> nn.Module:
    bias, shard = old.bias is not None, dict(sequence_parallel=sp, comm_overlap=overlap)
    with torch.device(old.weight.device):
        if style == "column" and isinstance(old, FusedLinear):  # q/k/v, gate/up: one GEMM, one f
            return ColumnParallelFusedLinear(old.in_features, old.parts, group, bias=bias, **shard)
        if style == "column":
            return ColumnParallelLinear(old.in_features, old.out_features, group, bias=bias, **shard)
        if bias:  # would need adding once after the all-reduce; no supported family has one
            raise ValueError("a row-parallel linear with a bias (o_proj/down_proj) is not supported")
        return RowParallelLinear(old.in_features, old.out_features, group, **shard)


def _grad_summed_norm(old: RMSNorm, group) -> SequenceParallelRMSNorm:
    """``old`` as an RMSNorm whose replicated weight's gradient is summed over tp in backward: the norms of a
    sequence-parallel layer (each rank sees s/tp tokens), and Qwen3's per-head q/k norms (each rank sees nh/tp
    heads; Megatron all-reduces qk_layernorm gradients over tp likewise, transformers' tp plan names them
    replicated_with_grad_allreduce)."""
    with torch.device(old.weight.device):
        return SequenceParallelRMSNorm(old.weight.shape[0], old.eps, group)


def apply_tensor_parallel(
    model: nn.Module, tp_group, sequence_parallel: bool = False, comm_overlap: bool = False
) -> nn.Module:
    """Swap the Llama model's linears and embedding for their tensor-parallel versions, in place; with
    ``sequence_parallel`` also the norms, and the stage's input and output become (b, s/tp, h); with
    ``comm_overlap`` (sequence parallelism only) the linears' collectives overlap their matmuls (module docstring).

    An MoE layer's experts and OLMoE's q/k norms are split by engine/parallel/tp/moe.py (experts tp-sharded, router
    replicated), its shared expert here like the MLP; Qwen3's per-head q/k norms stay whole, their gradients
    summed over tp (``_grad_summed_norm``).
    Call on the meta-device model before materialising (engine.model.init.materialize). Tied embeddings stay tied: the
    embedding and the LM head are sharded the same way (vocab rows). A tp group of size 1 leaves the model as is.
    """
    tp = dist.get_world_size(tp_group)
    if tp == 1:
        return model
    sp = sequence_parallel
    decoder = model.model
    for layer in decoder.layers.values():
        moe = isinstance(layer.mlp, MoE)  # its experts: engine/parallel/tp/moe.py; its shared expert: below
        for path, style in LAYER_PLAN.items():
            parent_name, attr = path.split(".")
            parent, linear_sp = getattr(layer, parent_name), sp
            if moe and parent_name == "mlp":  # the shared expert sees the block's gathered sequence: no sp
                parent, linear_sp = parent.shared_expert, False
            if parent is not None:
                linear = _parallel_linear(getattr(parent, attr), style, tp_group, linear_sp, comm_overlap)
                setattr(parent, attr, linear)
        if moe:
            shard_moe(layer.mlp, tp_group, sp)
        attn = layer.self_attn
        if attn.qk_norm_per_head:  # Qwen3: each rank normalises its nh/tp heads with the whole (hd,) weights
            for name in ("q_norm", "k_norm"):
                setattr(attn, name, _grad_summed_norm(getattr(attn, name), tp_group))
        elif attn.q_norm is not None:  # OLMoE's whole-projection q/k norms
            shard_qk_norms(attn, tp_group)
        for name in SEQUENCE_PARALLEL_NORMS if sp else ():
            setattr(layer, name, _grad_summed_norm(getattr(layer, name), tp_group))
    if sp:
        decoder.sequence_shards = tp  # RoPE positions count the whole sequence (engine/model/transformer.py)
        if decoder.norm is not None:
            decoder.norm = _grad_summed_norm(decoder.norm, tp_group)
    if decoder.embed_tokens is not None:
        old = decoder.embed_tokens
        with torch.device(old.weight.device):
            decoder.embed_tokens = VocabParallelEmbedding(
                old.num_embeddings, old.embedding_dim, tp_group, sequence_parallel=sp
            )
    if model.lm_head is not None:
        old = model.lm_head
        with torch.device(old.weight.device):  # under sp: gathers the (b, s/tp, h) final norm output
            model.lm_head = ColumnParallelLinear(
                old.in_features, old.out_features, tp_group, sequence_parallel=sp, comm_overlap=comm_overlap
            )
        if model.cfg.tie_embeddings and decoder.embed_tokens is not None:
            model.lm_head.weight = decoder.embed_tokens.weight
    return model
