"""The load-balanced head/tail split of a sequence over context-parallel ranks (engine/parallel/cp/layout.py)."""

import pytest
import torch

from engine.parallel.cp import layout


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_partition_the_sequence_with_equal_causal_work(cp):
    s = 8 * cp
    rows = layout.all_chunk_indices(s, cp)
    assert sorted(rows.reshape(-1).tolist()) == list(range(s))  # every token on exactly one rank
    # causal work of a query at index i is i + 1 keys: equal on every rank (what the head/tail split is for)
    work = [(r + 1).sum().item() for r in rows]
    assert len(set(work)) == 1
    assert layout.chunk_indices(s, cp, 0)[0] == 0 and layout.chunk_indices(s, cp, 0)[-1] == s - 1


def test_gathered_and_natural_order_are_inverse():
    x = torch.randn(2, 16, 3)
    g = layout.to_gathered_order(x, 16, 4)
    assert torch.equal(g[:, :4], layout.take(x, 16, 4, 0))
    assert torch.equal(layout.to_natural_order(g, 16, 4), x)


def test_sequence_must_split_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 8"):
        layout.chunk_indices(12, 4, 0)
