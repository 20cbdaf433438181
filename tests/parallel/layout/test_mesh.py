"""The named mesh (engine/parallel/layout/mesh.py, issue 25): every group asked for by name equals the group the
positional (pp, dp, tp) grid gave before it, at several layouts; the rank arithmetic equals torch's DeviceMesh layout
for any axis sizes (cp > 1 included); and ParallelContext's real process groups hold exactly those ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config import Config
from engine.parallel.layout.checks import Layout
from engine.parallel.layout.context import ParallelContext
from engine.parallel.layout.mesh import AXES, MODEL_PARALLEL, Mesh
from tests.dist import run_ranks

LAYOUTS = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 1, 4), (1, 4, 2), (8, 1, 1), (1, 1, 8), (1, 1, 1)]  # (tp, pp, dp)
DERIVED = ("mp", "embed")


def positional_groups(tp: int, pp: int, dp: int) -> dict[int, dict]:
    """rank -> its groups as context.py built them before issue 25, indexing grid = arange(world).reshape(pp, dp, tp)
    by position (its mp_group, embed_group, stage_ranks and mpu formulas, copied)."""
    grid = torch.arange(tp * pp * dp).reshape(pp, dp, tp)
    out = {}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                rank, end = grid[p, d, t].item(), pp > 1 and p in (0, pp - 1)  # middle stages: no embed group
                out[rank] = {
                    "coords": {"pp": p, "dp": d, "cp": 0, "tp": t},
                    "cp": [rank],
                    "tp": grid[p, d, :].tolist(),
                    "pp": grid[:, d, t].tolist(),
                    "dp": grid[p, :, t].tolist(),
                    "mp": grid[:, d, :].flatten().tolist(),
                    "embed": [grid[0, d, t].item(), grid[-1, d, t].item()] if end else None,
                    "mp_rank": p * tp + t,
                    "mp_size": tp * pp,
                    "tp_src": grid[p, d, 0].item(),
                }
    return out


def by_name(mesh: Mesh, rank: int) -> dict:
    ends = {r: pair for pair in mesh.ends_along("pp") for r in pair}
    mp = mesh.ranks_spanning(MODEL_PARALLEL, rank)
    return {
        "coords": mesh.coords(rank),
        **{axis: mesh.ranks_along(axis, rank) for axis in AXES},
        "mp": mp,
        "embed": ends.get(rank),
        "mp_rank": mp.index(rank),
        "mp_size": len(mp),
        "tp_src": mesh.ranks_along("tp", rank)[0],
    }


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_groups_by_name_equal_the_positional_grid(tp, pp, dp):
    mesh = Mesh(Layout(tp=tp, pp=pp, dp=dp).axes)
    assert mesh.names == AXES and mesh.world_size == tp * pp * dp
    assert {r: by_name(mesh, r) for r in range(mesh.world_size)} == positional_groups(tp, pp, dp)


@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (1, 3, 2, 2), (2, 1, 4, 1), (3, 2, 1, 2)])
def test_rank_arithmetic_is_device_mesh_layout(sizes):
    """Any sizes, cp > 1 included: the lines along an axis are those of arange(world).reshape(sizes) (the grid
    init_device_mesh builds), coords and rank_at are inverse, and groups_spanning partitions the world."""
    mesh = Mesh(tuple(zip(AXES, sizes)))
    grid = torch.arange(mesh.world_size).reshape(sizes)
    for i, axis in enumerate(AXES):
        lines = grid.movedim(i, -1).reshape(-1, sizes[i]).tolist()
        assert sorted(mesh.groups_spanning((axis,))) == sorted(lines), axis
        for line in lines:
            assert all(mesh.ranks_along(axis, r) == line for r in line)
    for rank in range(mesh.world_size):
        assert mesh.rank_at(mesh.coords(rank)) == rank
        assert list(mesh.coords(rank).values()) == [c.item() for c in torch.nonzero(grid == rank)[0]]
    for axes in [("dp", "cp"), MODEL_PARALLEL, AXES]:
        groups = mesh.groups_spanning(axes)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))


def test_unknown_axis_names_the_valid_ones():
    mesh = Mesh(Layout(tp=2, pp=1, dp=1).axes)
    with pytest.raises(KeyError, match="no parallel axis 'ep'; the axes are pp, dp, cp, tp"):
        mesh.ranks_along("ep", 0)


def _context_groups(layouts: list[tuple[int, int, int]]) -> list[dict]:
    """On each rank, for each layout: the ranks of every real process group ParallelContext returns by name, its
    DeviceMesh's coordinates and the DeepSpeed mpu answers."""
    out = []
    for tp, pp, dp in layouts:
        cfg = Config()
        cfg.parallel.tp, cfg.parallel.pp, cfg.train.micro_batch_size = tp, pp, 1
        ctx = ParallelContext.from_config(cfg)
        groups = {name: ctx.group(name) for name in AXES + DERIVED}
        out.append(
            {
                "coords": {axis: ctx.mesh.get_local_rank(axis) for axis in AXES},
                **{name: None if g is None else dist.get_process_group_ranks(g) for name, g in groups.items()},
                "mp_rank": ctx.get_model_parallel_rank(),
                "mp_size": ctx.get_model_parallel_world_size(),
                "tp_src": ctx.get_tensor_model_parallel_src_rank(),
                "dp_ranks": ctx.get_data_parallel_group_ranks(),
                "stages": ctx.stage_ranks,
                "shortcuts": (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.tp, ctx.pp, ctx.dp),
            }
        )
    return out


def test_context_groups_by_name_at_world_8():
    layouts = [(2, 2, 2), (1, 4, 2), (4, 1, 2)]
    results = run_ranks(_context_groups, 8, layouts, timeout_s=600)
    for i, (tp, pp, dp) in enumerate(layouts):
        expected = positional_groups(tp, pp, dp)
        for rank, per_layout in enumerate(results):
            got, want = dict(per_layout[i]), expected[rank]
            assert got.pop("dp_ranks") == want["dp"] and got.pop("stages") == want["pp"], (tp, pp, dp, rank)
            c = want["coords"]
            assert got.pop("shortcuts") == (c["tp"], c["pp"], c["dp"], tp, pp, dp), (tp, pp, dp, rank)
            assert got == want, (tp, pp, dp, rank)


@pytest.mark.parametrize("tp,pp,dp,ep", [(1, 1, 4, 2), (2, 2, 2, 2), (1, 2, 4, 4), (2, 1, 4, 1), (1, 1, 8, 2)])
def test_ep_groups_are_consecutive_dp_ranks_and_expert_dp_the_strided_rest(tp, pp, dp, ep):
    """Expert parallelism splits dp as Megatron's expert-data-parallel groups do: dp index = edp index * ep + ep
    index, so an ep group is ep consecutive dp ranks and its expert-dp group the dp ranks at the same ep index."""
    mesh = Mesh(Layout(tp=tp, pp=pp, dp=dp).axes)
    grid = torch.arange(mesh.world_size).reshape(pp, dp // ep, ep, tp)  # (pp, edp, ep, tp): the positional split
    want_ep = sorted(grid.movedim(2, -1).reshape(-1, ep).tolist())
    want_edp = sorted(grid.movedim(1, -1).reshape(-1, dp // ep).tolist())
    assert mesh.split_groups("dp", ep) == (want_ep, want_edp)
    for rank in range(mesh.world_size):
        group, strided = mesh.split_along("dp", ep, rank)
        assert group in want_ep and strided in want_edp and rank in group and rank in strided
    with pytest.raises(ValueError, match="3 does not divide the dp size"):
        mesh.split_along("dp", 3, 0)


def _ep_context(ep: int) -> dict:
    cfg = Config()
    cfg.model.family, cfg.model.num_experts, cfg.model.experts_per_token = "mixtral", 4, 2
    cfg.parallel.ep, cfg.train.micro_batch_size, cfg.train.global_batch_size = ep, 1, 8
    ctx = ParallelContext.from_config(cfg)
    ranks = {n: None if ctx.group(n) is None else dist.get_process_group_ranks(ctx.group(n)) for n in ("ep", "edp")}
    return {
        **ranks,
        "sizes": (ctx.size("ep"), ctx.size("edp")),
        "at": (ctx.axis_rank("ep"), ctx.axis_rank("edp")),
        "along": (ctx.ranks_along("ep"), ctx.ranks_along("edp")),
        "mesh": ctx.mesh_for("edp").mesh.tolist(),
    }  # what fsdp shards the experts over: the edp group


def test_context_builds_ep_and_expert_dp_groups_at_world_4():
    for rank, got in enumerate(run_ranks(_ep_context, 4, 2, timeout_s=300)):
        ep_group, edp_group = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        assert got == {
            "ep": ep_group,
            "edp": edp_group,
            "sizes": (2, 2),
            "at": (rank % 2, rank // 2),
            "along": (ep_group, edp_group),
            "mesh": edp_group,
        }, rank
