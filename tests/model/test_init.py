"""Layout-independent initialisation from seeded tiles (engine/model/init.py): a block drawn alone equals that
block of the whole tensor (whatever its alignment with the tiles), every tile has its own stream, and the values
are N(0, std). That tp 1, 2 and 4 start from the same weights is checked by tests/parallel/tp/test_tensor_parallel.py
(torch.equal per HF tensor), and pp by the parity matrix."""

from __future__ import annotations

import pytest
import torch

from engine.model import init


@pytest.mark.parametrize(
    "shape,start,block",
    [
        ((12, 10), (4, 0), (4, 10)),  # a row cut (column-parallel weight, tp 3, rank 1)
        ((12, 10), (0, 5), (12, 5)),  # a column cut (row-parallel weight, tp 2, rank 1)
        ((12, 10), (3, 2), (5, 7)),  # straddling tile edges on both dims
        ((30,), (20,), (10,)),  # 1-d
    ],
)
def test_a_block_alone_equals_that_block_of_the_whole(monkeypatch, shape, start, block):
    monkeypatch.setattr(init, "TILE", 2)  # 1-d tiles of 4: blocks cross several tiles, edge tiles are partial
    full = torch.Size(shape)
    whole = init.draw_box(99, full, (0,) * len(shape), shape, 1.0)
    alone = init.draw_box(99, full, start, block, 1.0)
    assert torch.equal(alone, whole[tuple(slice(s, s + b) for s, b in zip(start, block))])
    assert not torch.equal(alone, init.draw_box(98, full, start, block, 1.0))  # the key matters


def test_every_tile_has_its_own_stream(monkeypatch):
    monkeypatch.setattr(init, "TILE", 4)
    whole = init.draw_box(5, torch.Size([16, 16]), (0, 0), (16, 16), 1.0)
    tiles = [whole[r : r + 4, c : c + 4].flatten() for r in range(0, 16, 4) for c in range(0, 16, 4)]
    firsts = {t[0].item() for t in tiles}
    assert len(firsts) == len(tiles)  # no two tiles start alike (a seed ignoring a coordinate would repeat)


def test_values_are_normal_with_the_given_std():
    std = 0.02
    x = init.draw_box(7, torch.Size([1024, 1024]), (0, 0), (1024, 1024), std).double()  # 16 x 16 tiles
    # standard errors at n = 2^20: mean std/1024, std std/1448; bounds at 5 of them
    assert abs(x.mean().item()) < 5 * std / 1024
    assert abs(x.std().item() / std - 1) < 5 / 1448
    kurtosis = ((x / std) ** 4).mean().item()  # a normal's is 3 (standard error sqrt(96 / n) = 0.0096)
    assert abs(kurtosis - 3) < 0.05
    assert x.abs().max().item() < 7 * std
