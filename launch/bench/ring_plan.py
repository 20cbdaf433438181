"""Host time of ring attention's part plan (engine/parallel/cp/ring_plan.py) per call, i.e. per layer and forward.

    python launch/bench/ring_plan.py [--seqs 32768 131072] [--cps 4 8] [--doc-len 4096]

For each (seq, cp), plain causal and with documents of about --doc-len tokens (random borders, seeded): the time of
``plan`` for cp rank 1 (kinds from chunk ends, O(1) per part), and the time of reading every part's kind off its
full (c, c) mask instead (``mask_kind(part_mask(...))``, what planning cost before), with the parts computed and
how many of them need the math path's mask.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402

from engine.parallel.cp import layout, ring_plan  # noqa: E402


def _by_masks(indices: torch.Tensor, doc_ids: torch.Tensor | None, r: int) -> int:
    """Parts with anything to attend, read off their full masks (the reference planning)."""
    cp, half = indices.shape[0], indices.shape[1] // 2
    q_idx, n = indices[r], 0
    for src in range(cp):
        k_idx = indices[src]
        for qs in (slice(0, half), slice(half, 2 * half)):
            for ks in (slice(0, half), slice(half, 2 * half)):
                q_doc, k_doc = ring_plan.docs_at(doc_ids, q_idx[qs]), ring_plan.docs_at(doc_ids, k_idx[ks])
                n += ring_plan.mask_kind(ring_plan.part_mask(q_idx[qs], k_idx[ks], q_doc, k_doc)) is not None
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--cps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--doc-len", type=int, default=4096)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"{'seq':>7} {'cp':>3} {'docs':>5} {'plan ms':>9} {'by masks ms':>12} {'parts':>6} {'masked':>7}")
    for s in args.seqs:
        for cp in args.cps:
            indices = layout.all_chunk_indices(s, cp)
            borders = torch.rand(1, s, generator=gen) < 1 / args.doc_len
            for doc_ids in (None, torch.cumsum(borders.long(), 1)):
                start = time.perf_counter()
                p = ring_plan.plan(indices, doc_ids, 1, (ring_plan.FULL, ring_plan.CAUSAL))
                planned = time.perf_counter() - start
                start = time.perf_counter()
                n = _by_masks(indices, doc_ids, 1)
                masks = time.perf_counter() - start
                kinds = [kind for step in p.steps for *_, kind in step]
                assert len(kinds) == n, (len(kinds), n)
                print(
                    f"{s:>7} {cp:>3} {str(doc_ids is not None):>5} {planned * 1e3:>9.1f} {masks * 1e3:>12.1f} "
                    f"{len(kinds):>6} {kinds.count(ring_plan.MASKED):>7}"
                )


if __name__ == "__main__":
    main()
