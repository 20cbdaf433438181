"""What each micro-batch's forward and loss take on this rank: token ids, labels and the keyword inputs (RoPE
positions, document ids), under context parallelism this cp rank's tokens of the whole rows.

Every cp rank of a dp rank reads the same (b, s+1) rows (engine/data/feed.py). Labels are the tokens shifted by
one in the sequence's own order, so the shift comes first and the split (layout.take) second: a rank's last
token of its early chunk is labelled with the first token of the next chunk, which another rank holds. RoPE
positions are the global positions of the local tokens (or, under data.document_mask, positions within each
document, computed on the whole row and then taken), and the document ids stay whole: the attention core masks
across the split from them (engine/parallel/cp/apply.py).
"""

from __future__ import annotations

import torch

from engine.model.docmask import document_layout
from engine.parallel.cp import layout


def micro_batch_inputs(
    micro: list[torch.Tensor],
    count: int,
    eos_id: int | None,
    cp: int = 1,
    cp_rank: int = 0,
    seq_len: int = 0,
    device=None,
) -> tuple[list, list, list[dict] | None]:
    """micro: the (mbs, s+1) rows of each micro-batch on ``device`` (empty on a stage that reads none), count:
    micro-batches per pass, eos_id: the document separator under data.document_mask, else None. Returns (inputs, labels,
    extra): (mbs, s/cp) token ids and labels per micro-batch, and per micro-batch the forward's keyword inputs
    (None when the model's defaults hold: cp 1 without document masks)."""
    inputs, labels = [m[:, :-1] for m in micro], [m[:, 1:] for m in micro]  # (mbs, s) each: shift first
    extra = None
    if eos_id is not None:  # {position_ids, doc_ids}, (mbs, s) each
        extra = [dict(zip(("position_ids", "doc_ids"), document_layout(x, eos_id))) for x in inputs]
    if cp == 1:
        return inputs, labels, extra
    inputs = [layout.take(x, seq_len, cp, cp_rank) for x in inputs]  # (mbs, s/cp)
    labels = [layout.take(y, seq_len, cp, cp_rank) for y in labels]
    if extra is not None:  # doc-relative positions of the local tokens; the document ids stay whole (the mask's)
        extra = [
            {"position_ids": layout.take(e["position_ids"], seq_len, cp, cp_rank), "doc_ids": e["doc_ids"]}
            for e in extra
        ]
    else:  # no rows needed: a middle stage knows the positions too, (s/cp,) global positions of its tokens
        extra = [{"position_ids": layout.chunk_indices(seq_len, cp, cp_rank, device)}] * count
    return inputs, labels, extra
