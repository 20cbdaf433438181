"""The hang report's one line, from every rank's posted tail (engine/trust/hang.py): pure functions of the tails.

What a rank is doing: blocked in its last operation when that one is still open (a receive, a collective, or a send
posted with nothing run after it), otherwise computing (the schedule action it is in, no communication). Whom it
waits for: a receive's or a send's peer; for a collective, the group's members that are not in the same collective.
From the earliest blocked operation (lowest step, then the step's phase: schedule, loss, gradient sync, grad norm,
stop signal; then the longest wait) the report follows those "waits for" edges until it reaches a rank that is in no
communication (it never entered the operation its peer waits in), a group whose members are all in the operation
and none left it (a link or device fault), or a cycle (ranks that wait for each other, e.g. a receive from a rank
that never sends it).
"""

from __future__ import annotations

from engine.cluster.heartbeat import describe_ranks
from engine.trust.replicas import span

PHASES = {"data": 0, "pipeline": 1, "layer": 1, "loss": 2, "tied embedding": 3, "grad sync": 4, "grad norm": 5}
PHASES |= {"step stats": 6, "stop signal": 7}
ACTIONS = {
    "fwd": ("forward", "F"),
    "bwd": ("backward", "B"),
    "bwd_input": ("input backward", "B"),
    "bwd_weight": ("weight backward", "W"),
    "recv_fwd": ("receive", "recv F"),
    "send_fwd": ("send", "send F"),
    "recv_bwd": ("receive", "recv B"),
    "send_bwd": ("send", "send B"),
}


def blocked_in(tail: dict) -> dict | None:
    """The operation a rank waits in, or None when it computes (its last operation ended, or it is a send posted
    before the compute action the rank is in now)."""
    ops = tail.get("ops") or []
    if not ops or not ops[-1]["open"]:
        return None
    last = ops[-1]
    where = tail.get("where") or {}
    if last["kind"] == "send" and (where.get("action"), where.get("mb")) != (last["action"], last["mb"]):
        return None
    return last


def key(op: dict) -> tuple:
    """What makes two ranks' operations the same: kind, group members, purpose, step, and for a send or a receive its
    peer (two receives from different ranks are two operations, also where no group ranks were posted)."""
    peer = op["peer"] if op["kind"] in ("send", "recv") else None
    return op["kind"], tuple(op["ranks"] or ()), op["what"], op["step"], peer


def members(op: dict, world: int) -> list[int]:
    """A collective's global ranks: the world's, a posted list, or a posted ["range", start, stop, step]."""
    ranks = op["ranks"]
    if ranks is None:
        return list(range(world))
    return list(range(*ranks[1:])) if ranks and ranks[0] == "range" else list(ranks)


def waits_for(rank: int, tails: dict, world: int) -> list[int]:
    op = blocked_in(tails[rank])
    if op is None:
        return []
    if op["kind"] in ("send", "recv"):
        return [op["peer"]]
    ops = {r: blocked_in(t) for r, t in tails.items()}
    return [r for r in members(op, world) if r != rank and (ops.get(r) is None or key(ops[r]) != key(op))]


def order(rank: int, tails: dict) -> tuple:
    """Program order, as far as ranks can be compared: step, the step's phase, micro-batch; then the longest wait."""
    op = blocked_in(tails[rank])
    return op["step"], PHASES.get(op["what"], 9), op["mb"], -op["age_s"], rank


def chain(tails: dict, world: int) -> tuple[int, list[int], str]:
    """(rank whose operation is reported, the ranks it waits for, how the walk ended: idle | none-left | cycle |
    missing) from the earliest blocked operation."""
    blocked = sorted((r for r in tails if blocked_in(tails[r]) is not None), key=lambda r: order(r, tails))
    if not blocked:
        return min(tails), [], "idle"
    rank, path = blocked[0], [blocked[0]]
    while True:
        peers = waits_for(rank, tails, world)
        if not peers:
            return rank, [], "none-left"
        if any(p not in tails for p in peers):
            return rank, [p for p in peers if p not in tails], "missing"
        idle = [p for p in peers if blocked_in(tails[p]) is None]
        if idle:
            return rank, idle, "idle"
        fresh = [p for p in peers if p not in path]
        if not fresh:  # a cycle: report its earliest operation
            first = min(path[min(path.index(p) for p in peers) :], key=lambda r: order(r, tails))
            return first, waits_for(first, tails, world), "cycle"
        rank = fresh[0]
        path.append(rank)


def op_text(op: dict) -> str:
    """'all-reduce over dp (grad sync)', 'recv from rank 3 over pp (micro-batch 4, action B)'."""
    where = f"over {op['group']}" if op["group"] != "group" else f"over ranks {span(members(op, 0))}"
    text = f"{op['kind']} {'from' if op['kind'] == 'recv' else 'to'} rank {op['peer']} {where}"
    if op["kind"] not in ("send", "recv"):
        text = f"{op['kind']} {where}"
    detail = [op["what"]] if op["what"] not in ("pipeline",) else []
    if op["mb"] >= 0 and op["action"]:
        detail.append(f"micro-batch {op['mb']}, action {ACTIONS.get(op['action'], ('', op['action']))[1]}")
    return text + (f" ({'; '.join(detail)})" if detail else "")


def state_text(rank: int, tail: dict) -> str:
    op = blocked_in(tail)
    if op is not None:
        return f"rank {rank} waits in {op_text(op)} for {op['age_s']:.0f} s"
    where = tail.get("where") or {}
    name, short = ACTIONS.get(where.get("action", ""), ("", ""))
    ops = tail.get("ops") or []
    quiet = tail.get("idle_s") or (ops[-1]["age_s"] - ops[-1].get("took_s", 0.0) if ops else None)
    idle = f" for {quiet:.0f} s" if quiet else ""
    if not name:
        return f"rank {rank} is outside the pipeline schedule{idle}, in no communication"
    return f"rank {rank} is in its {name} (micro-batch {where['mb']}, action {short}){idle}, in no communication"


def on_hosts(ranks: list[int], tails: dict) -> str:
    """'ranks 17, 18 on host h3', grouped per host."""
    return describe_ranks(ranks, {r: t["host"] for r, t in tails.items()})


def diagnose(tails: dict, world: int) -> tuple[int, str]:
    """(the step the job hangs in, the one line) from the tails of the ranks that posted."""
    rank, peers, how = chain(tails, world)
    op = blocked_in(tails[rank])
    steps = [blocked_in(t)["step"] for t in tails.values() if blocked_in(t) is not None]
    step = min(steps) if steps else max(t["step"] for t in tails.values())
    waiting = sorted(r for r, t in tails.items() if blocked_in(t) is not None)
    head = f"error: hang at step {step}: {len(waiting)} of {world} ranks wait in communication"
    if op is None:
        return step, f"{head}; {'; '.join(state_text(r, tails[r]) for r in sorted(tails)[:4])}"
    same = sorted(r for r in waiting if key(blocked_in(tails[r])) == key(op))
    head += f"; {on_hosts(same, tails)} in {op_text(op)}"
    if how == "none-left":
        return step, f"{head}: every member entered it and none left it (a link or device fault)"
    if how == "missing":
        return step, f"{head}; {on_hosts(peers, tails)} never posted their state (dead or frozen: see the heartbeat)"
    states = ", ".join(state_text(p, tails[p]) for p in peers[:4])
    verb = {"recv": "never sent it", "send": "never received it"}.get(op["kind"], "never entered it")
    if how == "cycle":
        return step, f"{head}; {on_hosts(peers, tails)} {verb} (the ranks wait for each other in a cycle): {states}"
    return step, f"{head}; {on_hosts(peers, tails)} {verb}: {states}"
