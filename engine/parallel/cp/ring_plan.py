"""Which parts of each ring-attention step to compute, and how: planned on the host from global token indices.

A rank's L tokens are its two layout chunks (engine/parallel/cp/layout.py), so each step's (queries, keys) block is
cut into 2 x 2 parts of one query chunk against one key chunk. Under causal attention a key chunk lying wholly after
a query chunk leaves its part fully masked: it is skipped (half of every off-diagonal block under the head/tail
split, where that pays). A part is FULL (every key seen: no mask), CAUSAL (one chunk against itself: the lower
triangle) or MASKED (anything else, e.g. a document border inside it; mask from ``part_mask``).

Chunks are runs of consecutive tokens and document indices never decrease along a sequence
(engine/model/docmask.py: the count of EOS tokens before a token), so a part's kind follows from its chunks' first
and last tokens in O(1); only for indices or documents that break this is the (c, c) mask built to find out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL, CAUSAL, MASKED = "full", "causal", "masked"


def docs_at(doc_ids: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    """(b, s) document index of the whole sequence -> (b, L) of the tokens at global indices idx (L,)."""
    return None if doc_ids is None else doc_ids.index_select(1, idx)


def part_mask(
    q_idx: torch.Tensor, k_idx: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None
) -> torch.Tensor:
    """q_idx (cq,), k_idx (ck,) global token indices, q_doc (b, cq) / k_doc (b, ck) their documents or None ->
    (b or 1, 1, 1, cq, ck) bool, True: attend (query i sees key j iff j <= i, and both are in one document)."""
    mask = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)  # (cq, ck)
    if q_doc is not None:
        return (mask & (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)))[:, None, None]  # (b, 1, 1, cq, ck)
    return mask[None, None, None]


def mask_kind(mask: torch.Tensor) -> str | None:
    """A part's kind from its mask (b or 1, 1, 1, cq, ck): None when nothing is left to attend."""
    if not bool(mask.any()):
        return None
    if bool(mask.all()):
        return FULL
    cq, ck = mask.shape[-2:]
    if cq == ck and bool((mask == torch.ones(cq, ck, dtype=torch.bool).tril()).all()):
        return CAUSAL
    return MASKED


def _run(idx: torch.Tensor) -> tuple[int, int] | None:
    """(first, last) if idx (c,) is a run of consecutive ascending token indices, else None."""
    first, last = int(idx[0]), int(idx[-1])
    return (first, last) if last - first + 1 == len(idx) and bool((idx.diff() == 1).all()) else None


def part_kind(
    q_idx: torch.Tensor, k_idx: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, docs_sorted: bool
) -> str | None:
    """The kind of the part of queries q_idx against keys k_idx (documents as in ``part_mask``), None to skip it.
    ``docs_sorted``: document indices never decrease along the sequence."""
    q_run, k_run = _run(q_idx), _run(k_idx)
    if q_run is None or k_run is None or (q_doc is not None and not docs_sorted):
        return mask_kind(part_mask(q_idx, k_idx, q_doc, k_doc))
    (a, b), (c, d) = q_run, k_run  # queries a..b, keys c..d
    if c > b:
        return None  # every key after every query
    if q_doc is not None and not bool((k_doc[:, 0] == q_doc[:, -1]).all()):
        # a document border within tokens c..b (sorted documents: all of them in one document iff c's and b's)
        if d < a and bool((k_doc[:, -1] < q_doc[:, 0]).all()):
            return None  # every key before every query, in an earlier document, in every row
        return MASKED  # some query sees some key: key a (d >= a), or key d (d < a, a row with doc(d) == doc(a))
    if d <= a:
        return FULL
    return CAUSAL if (a, b) == (c, d) else mask_kind(part_mask(q_idx, k_idx, q_doc, k_doc))


def block_parts(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    docs_sorted: bool = False,
) -> list[tuple[slice, slice, str]]:
    """The parts of one block (queries q_idx (L,), keys k_idx (L,), documents (b, L) or None) with anything left
    to attend, as (query slice, key slice, kind)."""
    halves = 2 if len(q_idx) % 2 == 0 and len(k_idx) % 2 == 0 else 1
    cq, ck = len(q_idx) // halves, len(k_idx) // halves
    parts = []
    for a in range(halves):
        qs = slice(a * cq, (a + 1) * cq)
        for c in range(halves):
            ks = slice(c * ck, (c + 1) * ck)
            kind = part_kind(
                q_idx[qs],
                k_idx[ks],
                None if q_doc is None else q_doc[:, qs],
                None if k_doc is None else k_doc[:, ks],
                docs_sorted,
            )
            if kind is not None:
                parts.append((qs, ks, kind))
    return parts


@dataclass
class Plan:
    """Which parts of each ring step to compute (step t: the K/V of rank (r - t) mod cp) and their kinds, planned
    once per forward on the host and kept for backward: no device sync per part. The math path's masks are rebuilt
    at use from the host indices, never kept: a layer's saved state stays q, k, v, o and lse."""

    indices: torch.Tensor  # (cp, L) int64, host
    doc_ids: torch.Tensor | None  # (b, s) int64, host
    r: int
    steps: list[list[tuple[slice, slice, str]]]

    def mask(self, t: int, qs: slice, ks: slice, device: torch.device) -> torch.Tensor:
        """(b or 1, 1, 1, cq, ck) bool on ``device``: the part's ``part_mask``."""
        q_idx, k_idx = self.indices[self.r][qs], self.indices[(self.r - t) % len(self.steps)][ks]
        return part_mask(q_idx, k_idx, docs_at(self.doc_ids, q_idx), docs_at(self.doc_ids, k_idx)).to(device)


def merged(parts: list[tuple[slice, slice, str]], whole: int, causal_whole: bool) -> list[tuple[slice, slice, str]]:
    """Fewer, larger kernel calls for the same attention: the parts of a block of ``whole`` queries and keys as one
    CAUSAL part where ``causal_whole`` (the rank's own keys, ascending indices, no documents: query i sees key j
    iff j <= i in its layout order, the union of block_parts' causal, full, causal), and FULL parts beside each
    other (same queries and adjacent keys, or the reverse) as one. Each part is a fused kernel call and an
    online-softmax merge (ring.py); the tiny model at cp 2 computes 2 per layer where it computed 5."""
    if causal_whole and parts:
        return [(slice(0, whole), slice(0, whole), CAUSAL)]
    out: list[tuple[slice, slice, str]] = []
    for qs, ks, kind in parts:
        if out and kind == FULL and out[-1][2] == FULL:
            pq, pk, _ = out[-1]
            if pq == qs and pk.stop == ks.start:
                out[-1] = (qs, slice(pk.start, ks.stop), FULL)
                continue
            if pk == ks and pq.stop == qs.start:
                out[-1] = (slice(pq.start, qs.stop), ks, FULL)
                continue
        out.append((qs, ks, kind))
    return out


def plan(indices: torch.Tensor, doc_ids: torch.Tensor | None, r: int, fused_kinds: tuple[str, ...]) -> Plan:
    """The Plan of cp rank r over indices (cp, L) and doc_ids (b, s) or None; a part whose kind is not in
    ``fused_kinds`` (those the fused kernel runs here) is planned MASKED, for the math path; where the fused kernel
    runs both kinds, its parts are ``merged``."""
    indices = indices.cpu()
    doc_ids = None if doc_ids is None else doc_ids.cpu()
    docs_sorted = doc_ids is None or bool((doc_ids.diff(dim=1) >= 0).all())
    q_doc, cp = docs_at(doc_ids, indices[r]), indices.shape[0]
    fuse = FULL in fused_kinds and CAUSAL in fused_kinds
    ascending = doc_ids is None and bool((indices[r].diff() > 0).all())
    steps = []
    for t in range(cp):
        src = (r - t) % cp
        parts = block_parts(indices[r], indices[src], q_doc, docs_at(doc_ids, indices[src]), docs_sorted)
        if fuse:
            parts = merged(parts, indices.shape[1], ascending and t == 0)
        steps.append([(qs, ks, kind if kind in fused_kinds else MASKED) for qs, ks, kind in parts])
    return Plan(indices, doc_ids, r, steps)
