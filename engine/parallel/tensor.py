"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM", Sec. 3) and the plan that applies them.

A column-parallel linear splits the output features (weight rows) across the tp group; a row-parallel linear
splits the input features (weight columns) and all-reduces its output. Attention heads and the SwiGLU hidden dim
are split this way, so a block needs one all-reduce forward and one backward per sub-layer: q/k/v and gate/up are
fused linears (engine/model/fused.py), each one column-parallel GEMM behind one ``f``, so a decoder layer runs 2
all-reduces forward (o_proj, down_proj) and 2 backward (in front of qkv_proj, gate_up_proj), where separate q, k,
v, gate and up linears ran 5 backward (tests/test_tp_collectives.py counts them). The embedding and the
LM head split the vocabulary; the loss is computed on vocab-sharded logits without gathering them
(engine/parallel/cross_entropy.py, re-exported here).

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
from engine.parallel.comm import copy_to_parallel, gather_from_parallel, reduce_from_parallel, scatter_to_parallel
from engine.parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401 (tensor.vocab_parallel_cross_entropy: the public name)


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows: weight (out/tp, in), bias (out/tp,) split with it (Qwen2's q/k/v).
    Input copied (f), output sharded (b, s, out/tp)."""

    def __init__(self, in_features: int, out_features: int, group, gather_output: bool = False, bias: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.tp_rank, self.tp_size = _rank_size(group)
        self.in_features, self.out_features = in_features, out_features
        local = _divide(out_features, self.tp_size, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        self.tp_dims = {"weight": 0, "bias": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)  # (b, s, out/tp)
        return gather_from_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}/{self.tp_size}"


class ColumnParallelFusedLinear(ColumnParallelLinear):
    """A FusedLinear (engine/model/fused.py) split by rows per part: weight (sum(out)/tp, in) = [q_r; k_r; v_r]
    (gate_r, up_r), one GEMM behind one ``f``; output (b, s, sum(out)/tp), which the model splits per part."""

    def __init__(self, in_features: int, parts: dict[str, int], group, bias: bool = False):
        super().__init__(in_features, sum(parts.values()), group, bias=bias)
        for name, rows in parts.items():
            _divide(rows, self.tp_size, f"{name} out_features")
        self.parts = dict(parts)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, parts={self.parts}/{self.tp_size}"


class RowParallelLinear(nn.Module):
    """y = x A^T with A split by columns: weight (out, in/tp). Input sharded (b, s, in/tp), output all-reduced (g)."""

    def __init__(self, in_features: int, out_features: int, group, input_is_parallel: bool = True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.tp_rank, self.tp_size = _rank_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, self.tp_size, "in_features")))
        self.tp_dims = {"weight": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group)
        return reduce_from_parallel(F.linear(x, self.weight), self.group)  # partial sums (b, s, out) -> summed

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.tp_size}, out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with rows [rank*V/tp, (rank+1)*V/tp) on each rank; other ids give zeros, then all-reduce (g)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group):
        super().__init__()
        self.group = group
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
        return reduce_from_parallel(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}/{self.tp_size}, {self.embedding_dim}"


# The plan table: which sub-module of a DecoderLayer becomes which parallel layer.
LAYER_PLAN = {
    "self_attn.qkv_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.gate_up_proj": "column",
    "mlp.down_proj": "row",
}


def _parallel_linear(old: nn.Module, style: str, group) -> nn.Module:
    with torch.device(old.weight.device):
        if style == "column" and isinstance(old, FusedLinear):  # q/k/v, gate/up: one GEMM, one f
            return ColumnParallelFusedLinear(old.in_features, old.parts, group, bias=old.bias is not None)
        if style == "column":
            return ColumnParallelLinear(old.in_features, old.out_features, group, bias=old.bias is not None)
        if old.bias is not None:  # would need adding once after the all-reduce; no supported family has one
            raise ValueError("a row-parallel linear with a bias (o_proj/down_proj) is not supported")
        return RowParallelLinear(old.in_features, old.out_features, group)


def apply_tensor_parallel(model: nn.Module, tp_group) -> nn.Module:
    """Swap the Llama model's linears and embedding for their tensor-parallel versions, in place.

    Call on the meta-device model before materialising (engine.model.init.materialize). Tied embeddings stay tied: the
    embedding and the LM head are sharded the same way (vocab rows). A tp group of size 1 leaves the model as is.
    """
    if dist.get_world_size(tp_group) == 1:
        return model
    for layer in model.model.layers.values():
        for path, style in LAYER_PLAN.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, _parallel_linear(getattr(parent, attr), style, tp_group))
    decoder = model.model
    if decoder.embed_tokens is not None:
        old = decoder.embed_tokens
        with torch.device(old.weight.device):
            decoder.embed_tokens = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, tp_group)
    if model.lm_head is not None:
        old = model.lm_head
        with torch.device(old.weight.device):
            model.lm_head = ColumnParallelLinear(old.in_features, old.out_features, tp_group, gather_output=False)
        if model.cfg.tie_embeddings and decoder.embed_tokens is not None:
            model.lm_head.weight = decoder.embed_tokens.weight
    return model
