"""Process groups at scale (issue 43): the rank arithmetic that lists a group kind is O(N) for the whole world, and
a rank creates only the groups it belongs to (no world-wide step per group). Counted, never timed: Python function
calls made by the rank arithmetic at 16,384 ranks, and the ``new_group`` calls ParallelContext makes on simulated
ranks of a 1,024-rank world (torch's "fake" backend: a real process group of that size in one process, with no
peers to talk to)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from engine.parallel.layout.checks import Layout
from engine.parallel.layout.context import ParallelContext
from engine.parallel.layout.mesh import DATA_AXES, MODEL_PARALLEL, Mesh


def _calls(fn) -> int:
    """Python and builtin function calls made while ``fn()`` runs (sys.setprofile: a count, not a time)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_every_group_kind_is_listed_in_linear_rank_arithmetic_at_16384_ranks():
    """Every group of each kind (the axes, mp, embed, ep and expert-dp) for the whole world in at most two calls
    per rank (cp's 16,384 groups of one rank: one list each). Before issue 43 groups_spanning and split_groups
    asked for every rank's group (split_groups then searched the groups found so far): O(N^2), ~45 s per rank at
    16,384."""
    mesh = Mesh(Layout(tp=8, pp=8, dp=256).axes)
    world = mesh.world_size
    assert world == 16384
    kinds = {
        **{axis: (lambda a=axis: mesh.groups_spanning((a,))) for axis in mesh.names},
        "mp": lambda: mesh.groups_spanning(MODEL_PARALLEL),
        "embed": lambda: mesh.ends_along("pp"),
        "ep/edp": lambda: mesh.split_groups(DATA_AXES, 8),
    }
    for kind, fn in kinds.items():
        calls = _calls(fn)
        assert calls <= 2 * world, f"{kind}: {calls} calls for {world} ranks"
    blocks, strided = mesh.split_groups(DATA_AXES, 8)
    assert len(blocks) == world // 8 and len(strided) == world // 256 * 8  # a partition of the world each
    assert sorted(r for g in blocks for r in g) == list(range(world)) == sorted(r for g in strided for r in g)


@pytest.fixture
def fake_world():
    """A process group of ``world`` ranks seen from ``rank`` in this process (torch's fake backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 517, 1023])
def test_a_rank_creates_only_its_own_groups_at_1024_ranks(fake_world, monkeypatch, rank):
    """ParallelContext's own groups (mp, embed, ep, expert-dp; the axes are DeviceMesh's): one ``new_group`` per
    kind, each holding the rank, synchronised among its members only. Before issue 43 every rank created every
    group of every kind, each a world-wide step (under eager NCCL a split of the world communicator): 672 here."""
    fake_world(rank, 1024)
    layout = Layout(tp=8, pp=4, dp=32, ep=4)
    names, sizes = zip(*layout.axes)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    made, new_group = [], dist.new_group

    def counting(ranks=None, *args, **kwargs):
        made.append((list(ranks), kwargs.get("use_local_synchronization", False)))
        return new_group(ranks, *args, **kwargs)

    monkeypatch.setattr(dist, "new_group", counting)
    ctx = ParallelContext(layout, mesh, torch.device("cpu"), "gloo")
    assert len(made) <= 4, made
    assert all(rank in ranks and local for ranks, local in made), made
    named = Mesh(layout.axes)
    assert dist.get_process_group_ranks(ctx.group("mp")) == named.ranks_spanning(MODEL_PARALLEL, rank)
    assert dist.get_process_group_ranks(ctx.group("ep")) == ctx.ranks_along("ep")
    assert dist.get_process_group_ranks(ctx.group("edp")) == ctx.ranks_along("edp")
    embed = ctx.group("embed")
    ends = {r for pair in named.ends_along("pp") for r in pair}
    assert (embed is not None) == (rank in ends)
