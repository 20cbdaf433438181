"""Which decoder layers each pipeline stage holds: the one owner of every layer-to-stage split (no torch).

The stage split (executor.split_stage), the virtual chunks (virtual.model_chunks), the planner's memory and step
time (engine/planning/) and ``parallel.pp_layers``' even default (engine/planning/balance.py) all read it, so a
layer is on the same stage wherever it is asked. Layers keep their global indices (``model.layers.7`` on every
layout); a stage or chunk is a ``range`` of them.

- One chunk per stage (1F1B, GPipe, zero bubble): contiguous runs, given counts or the even split.
- Virtual stages (interleaved; Narayanan et al. 2021, Sec. 2.2.2): pp*v chunks, rank r holding virtual
  stages r, r+pp, ...; ZB-V (Qi et al. 2023, Sec. 6): 2 chunks in a V, virtual stages r and 2pp-1-r
  (actions.virtual_stage). Virtual stage g holds a contiguous run of layers, in g's order: the even split of pp*v
  runs, or one count per virtual stage (parallel.pp_layers in virtual-stage order; Llama 3 405B's 126 layers on pp
  16 x v 2 as [3, 4, ..., 4, 3]).
"""

from __future__ import annotations

from engine.parallel.pp.actions import virtual_stage


def stage_layer_ranges(num_layers: int, pp: int, counts: list[int] | None = None) -> list[range]:
    """Global layer indices of each stage: even split (earlier stages take the remainder) or explicit counts
    (already checked against pp and num_layers with the rest of the layout, in layout.checks.resolve_layout)."""
    if not counts:
        counts = [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def even_layers(num_layers: int, pp: int) -> list[int]:
    """As even as possible, the earlier stages taking the remainder (parallel.pp_layers empty)."""
    return [len(r) for r in stage_layer_ranges(num_layers, pp)]


def chunk_layer_ranges(
    num_layers: int, pp: int, v: int, vshape: bool = False, counts: list[int] | None = None
) -> list[list[range]]:
    """[rank][chunk] -> global layer indices: virtual stage g (chunk*pp + rank, or in a V r and 2pp-1-r) holds the
    g-th of pp*v contiguous runs, ``counts[g]`` layers long (one count per virtual stage, checked in
    layout.checks.check_schedule) or the even split's."""
    runs = stage_layer_ranges(num_layers, pp * v, counts)
    return [[runs[virtual_stage(pp, r, c, vshape)] for c in range(v)] for r in range(pp)]
