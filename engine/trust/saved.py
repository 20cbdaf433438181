"""A resume checked against what was saved (checkpoint.verify): a checkpoint records, beside its index, a digest of
every logical tensor's state (parameter, Adam moments) and the loss of a fixed probe batch; a resume recomputes
both from the state it loaded, at whatever layout, and refuses (CheckpointError: one line, exit 2) what differs.
A CRC catches a damaged file; this catches a file rewritten with a valid CRC, a wrong reshard, a run position
that is not the one saved, an optimizer state that is missing.

The digest of a tensor is exact and independent of the layout: the sum, modulo 2^64, over its elements of the
element's fp32 bit pattern times a weight of its place in the GLOBAL tensor (splitmix64 of its row times splitmix64
of its salted column, in the (rows, row length) view a checkpoint cuts). Sums modulo 2^64 do not depend
on how the elements are split or ordered, so each rank digests the pieces it writes (the same pieces, tp block and
flat range, that engine/checkpoint/contents.py snapshots) and rank 0 adds them up; a swapped pair of elements or
pieces changes the weights they are multiplied by, so it changes the digest (with probability 1 - 2^-64 per
mismatch). Computed on the device, in chunks, from the held state: nothing is gathered or copied whole.

The probe is one forward pass of a fixed batch (seeded tokens, the same at every layout) through the run's eval
schedule, at save after the step's update (the weights saved) and after the load: equal to within the parity
bounds of README "What is proven" (it is computed in another order at another layout).
"""

from __future__ import annotations

import torch

from engine.checkpoint.format import piece_key, tp_box
from engine.parallel.dp.state import slots

FIELD = "resume_check"  # the index's top-level header field (none in a checkpoint of an older engine)
KIND = "sum of fp32 bits x splitmix64(global row) x splitmix64(global column + 2^40) mod 2^64"
PROBE_SEED = 0x5EED_C0DE
# relative: twice the loss bounds of tests/parity/runner.py (fp32 1e-5; bf16 2e-3 at most), each layout's against
# one process, so two layouts within them differ by at most twice
PROBE_BOUND = {torch.float32: 2e-5, torch.bfloat16: 4e-3}  # train.dtype's two (fp16 weights are not trained)
_CHUNK = 1 << 22  # elements per step of a digest: bounded temporaries whatever the tensor's size
_COLUMN_SALT = 1 << 40  # column hashes are not row hashes: a transposed square block changes the digest
_MASK = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(i: torch.Tensor) -> torch.Tensor:
    """splitmix64's output for state (i + 1) * golden, int64 with wrap-around (a weight per global index)."""
    z = (i + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def piece_digest(values: torch.Tensor, shape: list[int], tp: tuple, lo: int) -> int:
    """The digest (0 <= d < 2^64) of ``values``: elements [lo, lo + n) of the flattened tp block ``tp`` =
    (tp_dim, tp_size, tp_rank) of a tensor of global ``shape``, in its (rows, row length) view. An element's weight
    is a row hash times a column hash (of its global row and column): per element a conversion, a product and a
    sum over a row (the column hashes are computed once per call), the row hashes once per row."""
    r0, _, c0, c1 = tp_box(shape, *tp)
    width, dev, n = c1 - c0, values.device, values.numel()
    columns = splitmix64(torch.arange(c0, c1, dtype=torch.int64, device=dev) + _COLUMN_SALT)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    done = 0
    while done < n:
        row, col = divmod(lo + done, width)
        rows = 1 if col or n - done < width else min((n - done) // width, max(1, _CHUNK // width))
        m = min(width - col, n - done) if rows == 1 else rows * width
        bits = values[done : done + m].float().view(torch.int32).to(torch.int64)
        sums = (bits.view(rows, -1) * columns[col : col + m // rows]).sum(dim=1)
        total += (sums * splitmix64(torch.arange(r0 + row, r0 + row + rows, dtype=torch.int64, device=dev))).sum()
        done += m
    return int(total.item()) & _MASK


def digests(parts) -> dict[str, dict[str, int]]:
    """{tensor name: {state: digest}} of the pieces this rank would write (engine/checkpoint/contents.py snapshot's),
    from the state it holds, in place (a resume's)."""
    access, out = parts.state(), {}
    for slot in slots(parts.model, access, parts.ctx, parts.cfg.model.tie_embeddings):
        if slot.write is None:
            continue
        for state in ["param", *access.state_names(slot)]:
            held = access.get(slot, state)
            for part in slot.parts:
                if part.write is None:
                    continue
                lo, hi = part.write
                values = held[part.at + lo - slot.start : part.at + hi - slot.start]
                d = piece_digest(values, part.shape, (slot.tp_dim, slot.tp_size, slot.tp_rank), lo)
                states = out.setdefault(part.name, {})
                states[state] = (states.get(state, 0) + d) & _MASK
    return out


def written(tensors: dict, params: dict) -> dict[str, dict[str, int]]:
    """The same digests from a save's CPU pieces as they are written (contents.py: ``piece_key`` -> fp32 tensor, and
    the rank's index entry placing them): in the writer thread of an async save, off the training loop."""
    out: dict[str, dict[str, int]] = {}
    for name, p in params.items():
        for state, pieces in p["states"].items():
            for tp_rank, lo, _ in pieces:
                values = tensors[piece_key(name, state, tp_rank, lo)]
                d = piece_digest(values, p["shape"], (p["tp_dim"], p["tp_size"], tp_rank), lo)
                states = out.setdefault(name, {})
                states[state] = (states.get(state, 0) + d) & _MASK
    return out


def combine(per_rank: list[dict]) -> dict[str, dict[str, str]]:
    """Rank 0: every rank's digests added per tensor and state, as 16 hex digits (JSON-safe)."""
    total: dict[str, dict[str, int]] = {}
    for ranks in per_rank:
        for name, states in ranks.items():
            for state, d in states.items():
                mine = total.setdefault(name, {})
                mine[state] = (mine.get(state, 0) + d) & _MASK
    return {name: {s: f"{d:016x}" for s, d in sorted(states.items())} for name, states in sorted(total.items())}


def probe_shape(cfg) -> list[int]:
    """The probe batch's shape (global batch, sequence length): a resume with another compares no probe loss."""
    return [cfg.train.global_batch_size, cfg.train.seq_len]


def record(position, probe: float | None, shape: list[int]) -> dict:
    """The header field a save writes: the run position it was taken at and the probe loss with its batch's shape
    (the digests and Adam's step count are added by rank 0 at the commit, ``at_commit``)."""
    return {
        "digest": KIND,
        "step": position.step,
        "consumed_samples": position.consumed_samples,
        "adam_step": None,
        "probe_loss": probe,
        "probe_batch": shape,
        "tensors": {},
    }


def at_commit(header: dict, metas: list[dict]) -> None:
    """Rank 0, committing a save: every rank's digests (taken out of its index entry) added into the record,
    with Adam's step count as the index holds it."""
    per_rank = [m.pop("digests", None) for m in metas]
    if FIELD in header:
        header[FIELD] |= {"adam_step": header.get("adam_step"), "tensors": combine([d or {} for d in per_rank])}


def compare(saved: dict, tensors: dict, position, adam_step: int | None, probe: tuple) -> list[str]:
    """Rank 0, after a load: what differs between the saved record and the loaded state (empty: nothing).
    ``probe``: (the loaded weights' probe loss or None, the params' dtype)."""
    wrong = []
    for key, now in (("step", position.step), ("consumed_samples", position.consumed_samples)):
        if saved.get(key) != now:
            wrong.append(f"the run position: {key} {now}, saved at {saved.get(key)} (a wrong schedule position)")
    if saved.get("adam_step") != adam_step:
        wrong.append(f"Adam's step count {adam_step}, saved at {saved.get('adam_step')} (a wrong schedule position)")
    for name in sorted(set(saved["tensors"]) | set(tensors)):
        was, now = saved["tensors"].get(name, {}), tensors.get(name, {})
        for state in sorted(set(was) | set(now)):
            if state not in now:
                wrong.append(f"{name} {state} was saved but not loaded (a missing optimizer state)")
            elif state not in was:
                wrong.append(f"{name} {state} was loaded but not saved")
            elif was[state] != now[state]:
                wrong.append(f"{name} {state} differs from what was saved (digest {now[state]}, saved {was[state]})")
    loss, dtype = probe
    saved_loss = saved.get("probe_loss")
    bound = PROBE_BOUND[dtype]
    if loss is not None and saved_loss is not None and abs(loss - saved_loss) > bound * max(abs(saved_loss), 1e-12):
        wrong.append(f"the probe batch's loss {loss:.7g}, saved {saved_loss:.7g} (beyond rel {bound:g})")
    return wrong


def verdict(path, wrong: list[str]) -> str | None:
    """The one line refusing a resume (None: it matches)."""
    if not wrong:
        return None
    more = f" (and {len(wrong) - 2} more)" if len(wrong) > 2 else ""
    return (
        f"{path} does not resume to the state that was saved: " + "; ".join(wrong[:2]) + more + "; a file rewritten "
        "with a valid CRC, a wrong reshard or an edited index: resume an older step (checkpoint.resume PATH), or "
        "set checkpoint.verify=false to resume it unchecked"
    )


def probe_batch(cfg, ctx, vocab: int, needs_batch: bool) -> torch.Tensor | None:
    """This dp rank's rows of the fixed probe batch: seeded tokens of one global batch, the same at any layout
    (None on a middle pipeline stage, as the feed's)."""
    if not needs_batch:
        return None
    t = cfg.train
    g = torch.Generator().manual_seed(PROBE_SEED)
    tokens = torch.randint(0, vocab, (t.global_batch_size, t.seq_len + 1), generator=g)
    return tokens.chunk(ctx.dp)[ctx.dp_rank].contiguous()
