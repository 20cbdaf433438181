"""The named rank mesh: which parallel axes there are, in which order, and which ranks share each group.

Issue 25: the one place that knows the axes and how ranks are laid out over them. Everything else asks by name
(``ctx.group("tp")``, ``ctx.axis_rank("pp")``, ``ctx.ranks_along("dp")``); nothing outside this module indexes the
rank grid by position (tests/test_layout.py checks it). The layout is row-major over ``AXES``, the last axis
fastest-varying (Megatron-Core's order, tp innermost so tensor-parallel peers share a node):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

which is ``torch.arange(world).reshape(pp, dp, cp, tp)``, the grid ``init_device_mesh`` builds from the same sizes.
cp (context parallelism) has size 1 until it exists: it then changes no rank. Expert parallelism (ep) is not an axis
but a split of the data ranks dp x cp, as Megatron's expert-data-parallel groups are: with g = dp_rank * cp + cp_rank
(the dp-major index the gradient group uses), g = edp_index * ep + ep_index, so an ep group is ep consecutive g
(``split_along``) and the expert-dp group the data ranks with the same ep index.

Pure rank arithmetic, no process groups: engine/parallel/layout/context.py creates the groups from these rank lists.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

AXES = ("pp", "dp", "cp", "tp")  # outermost first
DATA_AXES = ("dp", "cp")  # ranks along these hold the same parameters (cp: the same weights, other tokens)
# Megatron's model-parallel group: the ranks that together hold one copy of the parameters (every axis but the
# data axes); the global gradient norm is summed over it (engine/optim.py clip_gradients).
MODEL_PARALLEL = tuple(a for a in AXES if a not in DATA_AXES)


@dataclass(frozen=True)
class Mesh:
    """The sizes of the named axes, outermost first, and the rank arithmetic over them."""

    axes: tuple[tuple[str, int], ...]  # ((name, size), ...) in AXES order

    def __post_init__(self):
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names) or any(s < 1 for _, s in self.axes):
            raise ValueError(f"mesh axes {self.axes} need distinct names and sizes >= 1")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def size(self, axis: str) -> int:
        for name, size in self.axes:
            if name == axis:
                return size
        raise KeyError(f"no parallel axis {axis!r}; the axes are {', '.join(self.names)}")

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: this rank's index along it}, e.g. {"pp": 1, "dp": 0, "cp": 0, "tp": 1}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        out = {}
        for name, size in reversed(self.axes):  # the last axis varies fastest
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def ranks_spanning(self, axes: tuple[str, ...], rank: int) -> list[int]:
        """The ranks that share ``rank``'s coordinate on every axis not in ``axes``, ascending (row-major over
        ``axes`` in mesh order): one group of the product of those axes, e.g. ("pp", "tp") is Megatron's
        model-parallel group."""
        for axis in axes:
            self.size(axis)  # an unknown name fails here, naming the valid ones
        at = self.coords(rank)
        choices = [range(size) if name in axes else (at[name],) for name, size in self.axes]
        return [self.rank_at(dict(zip(self.names, values))) for values in itertools.product(*choices)]

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis``, by index along it (``ranks_along("pp", r)[i]``
        is stage i of r's pipeline)."""
        return self.ranks_spanning((axis,), rank)

    def groups_spanning(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group spanning ``axes`` (a partition of the world), ordered by their first rank. O(N) rank
        arithmetic: the groups are the rows of the grid with ``axes`` moved innermost (Megatron's RankGenerator)."""
        for axis in axes:
            self.size(axis)
        outer = [(n, s) for n, s in self.axes if n not in axes]
        inner = [(n, s) for n, s in self.axes if n in axes]
        # the offset of each member from the group's first rank, and the first rank of each group, both row-major
        members = _offsets(self.axes, inner)
        return [[first + m for m in members] for first in _offsets(self.axes, outer)]

    def ends_along(self, axis: str) -> list[list[int]]:
        """[first, last] rank of every line along ``axis``: along pp, Megatron's embedding groups (the two stages
        holding the tied embedding and LM head). Empty when the axis has size 1 (nothing to pair)."""
        if self.size(axis) == 1:
            return []
        return [[line[0], line[-1]] for line in self.groups_spanning((axis,))]

    def split_along(self, axes: str | tuple[str, ...], inner: int, rank: int) -> tuple[list[int], list[int]]:
        """``rank``'s line along ``axes`` (one axis, or several flattened row-major as ``ranks_spanning`` orders them)
        cut into blocks of ``inner`` consecutive indices: (its block, the ranks at its offset in every block). Along
        ("dp", "cp") with inner = ep: (the ep group, the expert-dp group), Megatron's ep carved from dp x cp."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        line = self.ranks_spanning(axes, rank)
        if inner < 1 or len(line) % inner:
            raise ValueError(f"{inner} does not divide the {' x '.join(axes)} size {len(line)}")
        at = line.index(rank)
        block = at // inner * inner
        return line[block : block + inner], line[at % inner :: inner]

    def split_groups(self, axes: str | tuple[str, ...], inner: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every group of ``split_along`` (inner blocks, strided), each list ordered by first rank; O(N): each line
        along ``axes`` is cut once."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        blocks, strided = [], []
        for line in self.groups_spanning(axes):
            if inner < 1 or len(line) % inner:
                raise ValueError(f"{inner} does not divide the {' x '.join(axes)} size {len(line)}")
            blocks += [line[i : i + inner] for i in range(0, len(line), inner)]
            strided += [line[i::inner] for i in range(inner)]
        return sorted(blocks), sorted(strided)


def _offsets(axes: tuple[tuple[str, int], ...], chosen: list[tuple[str, int]]) -> list[int]:
    """Row-major over the ``chosen`` axes (in mesh order), each combination's rank offset ``sum(index * stride)``."""
    strides, stride = {}, 1
    for name, size in reversed(axes):
        strides[name] = stride
        stride *= size
    out = [0]
    for name, size in chosen:
        out = [o + i * strides[name] for o in out for i in range(size)]
    return out
