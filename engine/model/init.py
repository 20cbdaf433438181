"""Layout-independent initialisation: the same weights at every tp, pp and dp.

Each parameter's full (unsharded) tensor is drawn from its own generator, seeded from the run seed and the
parameter's global Hugging Face name (a fused q/k/v or gate/up weight: each part's, engine/model/fused.py), and
each rank keeps only its slice. A parameter's values therefore depend on neither the tensor-parallel size, nor
which pipeline stage holds it, nor the order in which modules were built, nor the fusion.
Distributions follow HF ``LlamaPreTrainedModel._init_weights``: N(0, std) for linears and embeddings, ones for
norms, zeros for biases.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from engine.model.fused import part_blocks
from engine.parallel.shards import tp_dim


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _full_value(name: str, shape: torch.Size, seed: int, std: float) -> torch.Tensor:
    """The unsharded initial value of parameter ``name`` (fp32, on CPU: identical bits on every machine)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):  # HF _init_weights zeroes linear biases
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _local_slice(full: torch.Tensor, module: nn.Module, attr: str) -> torch.Tensor:
    """Cut this tp rank's shard from the full tensor using the module's ``tp_dims`` record."""
    dim = tp_dim(module, attr)
    if dim is None:
        return full
    return full.chunk(module.tp_size, dim=dim)[module.tp_rank]


def full_shape(module: nn.Module, attr: str, local: torch.Size) -> torch.Size:
    """Global shape of a (possibly tp-sharded) parameter."""
    dim = tp_dim(module, attr)
    if dim is None:
        return local
    shape = list(local)
    shape[dim] *= module.tp_size
    return torch.Size(shape)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, aliases: dict[str, str] | None = None) -> None:
    """Fill every parameter of ``model`` (already on its device) with its layout-independent initial value.
    ``aliases`` maps a name to the name whose value it takes (a tied LM head on a stage without the embedding)."""
    aliases = aliases or {}
    done: set[int] = set()
    for mod_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in done:  # tied weights: first name wins (model.embed_tokens before lm_head)
                continue
            done.add(id(param))
            name = f"{mod_name}.{attr}" if mod_name else attr
            flat = param.view(-1)
            # Each Hugging Face tensor the parameter holds (q, k and v of a fused qkv_proj) from its own name.
            for part, at, shape in part_blocks(module, name, param.shape):
                part = aliases.get(part, part)
                full = _full_value(part, full_shape(module, attr, shape), seed, std)
                flat[at:at + shape.numel()].copy_(_local_slice(full, module, attr).reshape(-1))


def materialize(model: nn.Module, device: torch.device, seed: int, std: float) -> nn.Module:
    """Allocate a meta-device model on ``device`` and initialise it. Tied weights are re-tied after allocation."""
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings
    model.to_empty(device=device)
    if tied and model.lm_head is not None and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    init_parameters(model, seed, std, {"lm_head.weight": "model.embed_tokens.weight"} if tied else None)
    return model
