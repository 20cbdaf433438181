"""Which tokens of a sequence each context-parallel rank holds: the load-balanced head/tail split.

Under causal attention the work of a query grows with its position, so cutting the sequence into cp contiguous
pieces gives the last rank cp times the first one's work. The sequence is cut instead into 2 cp chunks of
s / (2 cp) tokens, and cp rank r holds chunks r and 2 cp - 1 - r (one early, one late), so every rank does the same
work: Megatron-Core's context parallelism and Llama 3 (Dubey et al. 2024, Sec. 3.3.2) split it this way.
Pure index arithmetic: the data feed slices tokens with it, attention masks and RoPE read global positions from it.
"""

from __future__ import annotations

import torch


def check_divisible(seq_len: int, cp: int) -> None:
    """The split needs 2 cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 * cp = {2 * cp}")


def chunk_indices(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """(seq_len / cp,) int64: the global token indices cp rank ``cp_rank`` holds, in its local order (chunk r, then
    chunk 2 cp - 1 - r). cp = 1: 0..seq_len-1."""
    check_divisible(seq_len, cp)
    c = seq_len // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat((first, last))


def all_chunk_indices(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """(cp, seq_len / cp): row r is ``chunk_indices(seq_len, cp, r)``; concatenated, the order an all-gather over
    cp returns the sequence in."""
    return torch.stack([chunk_indices(seq_len, cp, r, device) for r in range(cp)])


def take(x: torch.Tensor, seq_len: int, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of x, whose ``dim`` is the whole sequence (seq_len): (..., s, ...) -> (..., s/cp, ...)."""
    return x.index_select(dim, chunk_indices(seq_len, cp, cp_rank, x.device))


def to_natural_order(x: torch.Tensor, seq_len: int, cp: int, dim: int = 1) -> torch.Tensor:
    """x holds the sequence in gathered order (rank 0's tokens, then rank 1's, ...) along ``dim``: put it in token
    order 0..s-1."""
    order = all_chunk_indices(seq_len, cp, x.device).reshape(-1)  # gathered position -> token index
    return x.index_select(dim, torch.argsort(order))


def to_gathered_order(x: torch.Tensor, seq_len: int, cp: int, dim: int = 1) -> torch.Tensor:
    """The inverse of ``to_natural_order``: token order -> rank 0's tokens, then rank 1's, ..."""
    return x.index_select(dim, all_chunk_indices(seq_len, cp, x.device).reshape(-1))
