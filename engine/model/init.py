"""Layout-independent initialisation: the same weights at every tp, pp and dp, on every device.

Each parameter's full (unsharded) tensor is cut into fixed tiles of TILE x TILE values (2-d) or TILE^2 values
(1-d), each drawn from its own CPU generator, seeded from the run seed, the parameter's global Hugging Face name (a
fused q/k/v or gate/up weight: each part's, engine/model/fused.py) and the tile's coordinates. A rank draws only the
tiles that overlap its tp slice, and copies the slice to its device once. A parameter's values therefore depend on
neither the tensor-parallel size, nor which pipeline stage holds it, nor the order in which modules were built,
nor the fusion, nor the device (the CPU generator gives the same bits everywhere; CUDA's gives others). Drawing the
whole tensor and slicing it cost every rank the whole stage's draw at any tp (launch/bench/init.py).
Distributions follow HF ``LlamaPreTrainedModel._init_weights``: N(0, std) for linears and embeddings, ones for
norms, zeros for biases.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from engine.model.fused import part_blocks
from engine.model.shards import tp_dim

TILE = 256  # 2-d tiles of 256 x 256 values (1-d: 65536): ~20k generators for 1B parameters
MASK64 = (1 << 64) - 1


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _mix(a: int, b: int) -> int:
    """SplitMix64's finaliser of a + b (Steele et al. 2014; Vigna's splitmix64.c): distinct tiles, unrelated seeds."""
    z = (a + (b + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def draw_box(key: int, full: torch.Size, start: tuple[int, ...], size: tuple[int, ...], std: float) -> torch.Tensor:
    """The block of shape ``size`` at corner ``start`` of the (never built) full N(0, std) tensor of shape ``full``
    (1-d or 2-d) of stream ``key``, on the CPU: only the tiles that overlap it are drawn."""
    if len(full) == 1:  # one row of 1-d tiles of TILE^2 values
        return _draw_2d(key, (1, full[0]), (0, start[0]), (1, size[0]), std, (1, TILE * TILE)).reshape(size)
    if len(full) != 2:
        raise ValueError(f"initialisation takes 1-d or 2-d parameters, not shape {tuple(full)}")
    return _draw_2d(key, tuple(full), tuple(start), tuple(size), std, (TILE, TILE))


def _draw_2d(key: int, full: tuple, start: tuple, size: tuple, std: float, tile: tuple) -> torch.Tensor:
    (r0, c0), (rows, cols), (th, tw) = start, size, tile
    t_rows, t_cols = range(r0 // th, -(-(r0 + rows) // th)), range(c0 // tw, -(-(c0 + cols) // tw))
    # Every overlapping tile drawn in place into its own contiguous slot, then one copy: a copy per tile costs
    # more than its draw on a busy machine.
    grid = torch.empty(len(t_rows), len(t_cols), th, tw)
    for i, tr in enumerate(t_rows):
        for j, tc in enumerate(t_cols):
            gen = torch.Generator().manual_seed(_mix(_mix(key, tr), tc) & (2**63 - 1))
            h, w = min(th, full[0] - tr * th), min(tw, full[1] - tc * tw)
            if (h, w) == (th, tw):
                grid[i, j].normal_(0.0, std, generator=gen)
            else:  # an edge tile, drawn at its own (contiguous) shape; the rest of its slot lies outside `full`
                grid[i, j, :h, :w] = torch.empty(h, w).normal_(0.0, std, generator=gen)
    top, left = t_rows[0] * th, t_cols[0] * tw
    band = grid.permute(0, 2, 1, 3).reshape(len(t_rows) * th, len(t_cols) * tw)  # tiles side by side
    return band[r0 - top : r0 - top + rows, c0 - left : c0 - left + cols]


def _fill_slice(out: torch.Tensor, name: str, module: nn.Module, attr: str, seed: int, std: float) -> None:
    """Fill ``out`` (this rank's tp slice of HF tensor ``name``, in place on its device) with its initial value."""
    if name.endswith("norm.weight"):
        out.fill_(1.0)
        return
    if name.endswith(".bias"):  # HF _init_weights zeroes linear biases
        out.zero_()
        return
    full = full_shape(module, attr, out.shape)
    start = [0] * out.dim()
    dim = tp_dim(module, attr)
    if dim is not None:  # the corner of torch.chunk(full, tp_size, dim)[tp_rank]
        start[dim] = module.tp_rank * -(-full[dim] // module.tp_size)
    out.copy_(draw_box(_param_seed(seed, name), full, tuple(start), tuple(out.shape), std))


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
                _fill_slice(flat[at : at + shape.numel()].view(shape), aliases.get(part, part), module, attr, seed, std)


def materialize(model: nn.Module, device: torch.device, seed: int, std: float) -> nn.Module:
    """Allocate a meta-device model on ``device`` and initialise it. Tied weights are re-tied after allocation."""
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings
    model.to_empty(device=device)
    if tied and model.lm_head is not None and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    init_parameters(model, seed, std, {"lm_head.weight": "model.embed_tokens.weight"} if tied else None)
    return model
