"""Fused projections: q/k/v and gate/up each as one GEMM (Megatron-LM's ``linear_qkv`` and ``linear_fc1``), with
Hugging Face's tensors at every boundary a user sees.

``FusedLinear`` stacks its *parts* (Hugging Face linears reading the same input) by rows: weight (sum(out), in),
bias (sum(out),); ``split_output`` cuts its output into one tensor per part. Under tensor parallelism
(engine/parallel/tp/layers.py, ``ColumnParallelFusedLinear``) tp rank r holds block r of every part, [q_r; k_r; v_r]
with q_r = q.chunk(tp, 0)[r]: the tp-global fused tensor is the per-rank interleaving [q_0; k_0; v_0; q_1; k_1;
v_1; ...] (``interleave``), so a rank's contiguous slice holds its own heads' q, k and v, and one GEMM with one
all-reduce in backward serves all three (Shoeybi et al. 2019, Sec. 3: one ``f`` per column-parallel input
instead of one per linear).

The parts stay the model's identity outside the forward:
- ``part_blocks``: the Hugging Face tensors a local parameter holds, as (name, flat offset, local shape).
  Initialisation (engine/model/init.py) draws each part from its own HF name, so every tp size and the code
  before the fusion start from the same values; checkpoints (engine/parallel/dp/state.py) and HF import/export
  (engine/hf/convert.py, init.py) write and read q_proj/k_proj/v_proj/gate_proj/up_proj, reshardable to any tp.
- ``hf_state_dict_hooks``: ``model.state_dict()`` gives HF names (each rank's tp block of them under tp) and
  ``load_state_dict`` takes them; names of the fused form are accepted too.
"""

from __future__ import annotations

import torch
from torch import nn

ATTRS = ("weight", "bias")


class FusedLinear(nn.Linear):
    """The linears of ``parts`` over one input as one GEMM: y = x W^T + b with W = [W_0; W_1; ...] (sum(out), in),
    split by the caller with ``split_output``. A plain nn.Linear otherwise (so DTensor's ColwiseParallel applies
    to it too, launch/bench/tp.py). ``parts``: Hugging Face module name -> output features, in stacking order."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}"


def split_output(module: nn.Module, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(b, s, sum(out)/tp) -> one (b, s, out_i/tp) view per part: the width split in the ratio of the parts (1/tp of
    each under tensor parallelism, which needs every part divisible by tp)."""
    total = sum(module.parts.values())
    return y.split([n * y.shape[-1] // total for n in module.parts.values()], dim=-1)


def _part_names(name: str, parts: dict[str, int]) -> list[str]:
    """'...self_attn.qkv_proj.weight' -> ['...self_attn.q_proj.weight', '...k_proj.weight', '...v_proj.weight']."""
    module_path, _, attr = name.rpartition(".")
    parent = module_path.rpartition(".")[0]
    return [f"{parent}.{part}.{attr}" if parent else f"{part}.{attr}" for part in parts]


def part_blocks(module: nn.Module, name: str, local_shape: torch.Size) -> list[tuple[str, int, torch.Size]]:
    """(Hugging Face name, flat offset in the local tensor, local shape) of each tensor the parameter ``name`` of
    ``module`` holds: the parameter itself, one row block per part of a fused linear, or what the module's own
    ``hf_blocks`` says (stacked experts: each expert's gate, up and down)."""
    local_shape = torch.Size(local_shape)
    if hasattr(module, "hf_blocks"):  # a module naming its own HF tensors (engine/model/moe.py: per-expert ones)
        return module.hf_blocks(name, local_shape)
    parts = getattr(module, "parts", None)
    if not parts:
        return [(name, 0, local_shape)]
    total, out, at = sum(parts.values()), [], 0
    for part, rows in zip(_part_names(name, parts), parts.values()):
        shape = torch.Size([rows * local_shape[0] // total, *local_shape[1:]])
        out.append((part, at, shape))
        at += shape.numel()
    return out


def by_hf_name(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, nn.Module, str]]:
    """Tensors keyed by parameter name (values, gradients, optimizer copies; local to the rank) -> keyed by Hugging
    Face name: (its part, a view; the module holding it; the attribute), fused q/k/v and gate/up split."""
    modules, out = dict(model.named_modules()), {}
    for name, t in tensors.items():
        mod_name, _, attr = name.rpartition(".")
        module, flat = modules[mod_name], t.reshape(-1)
        for part, at, shape in part_blocks(module, name, t.shape):
            out[part] = (flat[at : at + shape.numel()].view(shape), module, attr)
    return out


def interleave(stacked: torch.Tensor, parts: dict[str, int], tp: int) -> torch.Tensor:
    """The tp-global form of a fused tensor: [q; k; v] stacked by parts -> [q_0; k_0; v_0; q_1; ...], whose
    ``chunk(tp, 0)[r]`` is tp rank r's local fused tensor."""
    pieces = stacked.split(list(parts.values()), dim=0)
    return torch.cat([p.chunk(tp, dim=0)[r] for r in range(tp) for p in pieces], dim=0)


def _fused_children(parent: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in parent.named_children() if getattr(m, "parts", None)]


def _to_parts(parent: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: each fused tensor replaced, in place in the order, by its parts under their HF names.
    The parent's entries are the last ones of the dict when its hook runs, so only they are re-inserted."""
    fused = {f"{prefix}{child}.{attr}": module for child, module in _fused_children(parent) for attr in ATTRS}
    mine = []
    for key in reversed(state_dict):
        if not key.startswith(prefix):
            break
        mine.insert(0, key)
    if not any(k in fused for k in mine):
        return
    for key in mine:
        value = state_dict.pop(key)
        if key not in fused:
            state_dict[key] = value
            continue
        offset = 0  # value (sum(out)/tp, in) or (sum(out)/tp,) -> (out_i/tp, ...) views
        for part, _, shape in part_blocks(fused[key], key, value.shape):
            state_dict[part] = value.narrow(0, offset, shape[0])
            offset += shape[0]


def _from_parts(parent: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook (on the parent: its children only see keys under their own prefix): parts given
    under their HF names are stacked into the fused tensor; a part missing leaves the keys for strict to report."""
    for child, module in _fused_children(parent):
        for attr in ATTRS:
            key = f"{prefix}{child}.{attr}"
            names = _part_names(key, module.parts)
            if key not in state_dict and all(n in state_dict for n in names):
                state_dict[key] = torch.cat([state_dict.pop(n) for n in names], dim=0)


def hf_state_dict_hooks(parent: nn.Module) -> None:
    """Make ``state_dict``/``load_state_dict`` of ``parent`` (and any model holding it) speak the HF names of its
    fused children's parts, whatever the children are at call time (plain or tensor-parallel)."""
    parent.register_state_dict_post_hook(_to_parts)
    parent.register_load_state_dict_pre_hook(_from_parts)
