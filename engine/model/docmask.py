"""Document masking of packed sequences (Dubey et al. 2024, "The Llama 3 Herd of Models", Sec. 3.2: attention
does not cross document boundaries within a sequence).

A packed row holds several documents, each ending with the EOS token. ``document_layout`` gives every token its
document index (the number of EOS tokens before it) and its RoPE position within that document, so that a packed
row computes exactly what each of its documents would compute on its own. The mask is SDPA's boolean form
(True: attend): causal and block-diagonal over documents.
"""

from __future__ import annotations

import torch


def document_layout(ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (b, s) -> (position_ids, doc_ids), both (b, s) int64. A token after an EOS starts a new document."""
    eos = (ids == eos_id).long()  # (b, s)
    doc_ids = torch.cumsum(eos, dim=1) - eos  # EOS tokens before each token: the EOS itself closes its document
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (b, s)
    # Start of each token's document: the largest index <= i whose predecessor is an EOS (or 0).
    starts = torch.zeros_like(ids)
    starts[:, 1:] = torch.where(eos[:, :-1].bool(), index[:, 1:], 0)
    starts = torch.cummax(starts, dim=1).values
    return index - starts, doc_ids


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (b, s) -> (b, 1, s, s) bool: query i may attend key j iff j <= i and both are in one document."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()  # (s, s)
    same = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)  # (b, s, s)
    return (same & causal).unsqueeze(1)
