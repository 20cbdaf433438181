"""NCCL's point-to-point rules over gloo, so that CPU tests catch what only breaks on GPUs (issue 24).

Gloo is forgiving where NCCL is not: its ``batch_isend_irecv`` returns one Work per op and its sends need no
receiver to be waiting. ``install()`` (tests/dist.py does it in every forked rank) replaces
``torch.distributed.batch_isend_irecv`` with a synchronous version that behaves as NCCL does:

- ONE Work for the whole batch (NCCL coalesces the batch: ``_coalescing_manager`` -> ``cm.works``), so a caller
  that zips the returned Works with its ops drops every op after the first;
- rendezvous: an op completes only when the batch holding its partner op on the peer has STARTED (a send alone
  never completes); messages of one (group, src, dst) are matched in posting order (per-pair FIFO, no tags);
- a rank's batches run in issue order, one at a time (one stream): the call returns when the batch completed;
- a send whose matching receive has another shape or dtype is refused (NCCL would hang or corrupt).

How: at a batch's start the rank posts its gloo receives and writes, in the default group's store, one key per op
("rank d started its k-th receive from s", value: shape and dtype; "rank s started its k-th send to d"). A send is
posted to gloo once its receiver's key exists; a receive is done once its sender's key exists and gloo delivered.
While blocked the rank publishes what it waits for; a cycle of ranks each waiting on the next, unchanged over two
looks, is a deadlock and raises ``NcclRulesError("NCCL rules: deadlock ...")`` within about
``ENGINE_NCCL_SHIM_CHECK_S`` (1 s) -- a busy machine only slows a wait, it never forms a cycle, so no false alarm.
A wait that is no cycle (a peer stuck in a collective, or dead) fails after ``ENGINE_NCCL_SHIM_TIMEOUT_S`` (300 s).
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

PREFIX = "nccl_shim"


class NcclRulesError(RuntimeError):
    """A batch that NCCL would deadlock on or refuse."""


class BatchWork:
    """The one Work NCCL returns for a coalesced batch. The shim is synchronous: the batch is complete on return."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None


def _signature(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


class _Rules:
    """Per-process state: message counters per (group, src, dst) and the number of batches issued."""

    def __init__(self, original):
        self.original, self.counts, self.batches = original, {}, 0
        self.check_s = float(os.environ.get("ENGINE_NCCL_SHIM_CHECK_S", "1"))
        self.timeout_s = float(os.environ.get("ENGINE_NCCL_SHIM_TIMEOUT_S", "300"))

    def _next(self, group: str, src: int, dst: int) -> int:
        k = self.counts.get((group, src, dst), 0)
        self.counts[group, src, dst] = k + 1
        return k

    def batch(self, ops: list) -> list:
        """Run one batch under NCCL's rules; returns [BatchWork()]."""
        c10d._check_p2p_op_list(ops)
        store, me = c10d._get_default_store(), dist.get_rank()
        self.batches += 1
        plan, marks = [], {}
        for op in ops:  # receives first to gloo, so a sender whose key check passes never waits on gloo
            group, is_send = op.group.group_name, op.op is dist.isend
            src, dst = (me, op.peer) if is_send else (op.peer, me)
            k = self._next(group, src, dst)
            mine = f"{PREFIX}/{group}/{'send' if is_send else 'recv'}/{src}-{dst}/{k}"
            partner = f"{PREFIX}/{group}/{'recv' if is_send else 'send'}/{src}-{dst}/{k}"
            work = None if is_send else dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)
            plan.append(
                {"op": op, "send": is_send, "peer": op.peer, "k": k, "partner": partner, "work": work, "done": False}
            )
            marks[mine] = _signature(op.tensor)
        store.multi_set(list(marks), list(marks.values()))
        self._wait_partners(store, me, plan)
        deadline = datetime.timedelta(seconds=self.timeout_s)
        for p in plan:
            p["work"].wait(deadline)
        store.set(f"{PREFIX}/state/{me}", json.dumps({"batch": self.batches, "waits": []}))
        return [BatchWork()]

    def _wait_partners(self, store, me: int, plan: list) -> None:
        """Post each send once its receiver started; done once every partner's batch started."""
        start = last_check = time.monotonic()
        published, pause = False, 1e-4
        while True:
            for i, p in enumerate(plan):
                if p["done"] or not store.check([p["partner"]]):
                    continue
                if p["send"]:
                    if any(q["send"] and q["peer"] == p["peer"] and not q["done"] for q in plan[:i]):
                        continue  # per-pair FIFO: an earlier send to this peer goes first
                    want = store.get(p["partner"]).decode()
                    if want != _signature(p["op"].tensor):
                        raise NcclRulesError(
                            f"NCCL rules: rank {me} sends a {_signature(p['op'].tensor)} tensor as message {p['k']} "
                            f"to rank {p['peer']}, whose matching receive expects {want}"
                        )
                    op = p["op"]
                    p["work"] = dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
                p["done"] = True
            missing = [p for p in plan if not p["done"]]
            if not missing:
                return
            now = time.monotonic()
            if not published:
                store.set(
                    f"{PREFIX}/state/{me}",
                    json.dumps(
                        {
                            "batch": self.batches,
                            "desc": describe(plan),
                            "waits": [[p["peer"], p["partner"]] for p in missing],
                        }
                    ),
                )
                published = True  # the waits only shrink; a stale extra entry is re-checked against the store
            if now - last_check >= self.check_s:
                last_check = now
                cycle = find_cycle(store, me)
                if cycle is not None:
                    time.sleep(min(0.5, self.check_s))
                    if find_cycle(store, me) == cycle:
                        raise NcclRulesError(f"NCCL rules: deadlock: {cycle_text(cycle)}")
            if now - start > self.timeout_s:
                raise NcclRulesError(
                    f"NCCL rules: rank {me} batch {self.batches} [{describe(plan)}] waited "
                    f"{self.timeout_s:.0f} s for " + ", ".join(p["partner"] for p in missing)
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)


def describe(plan: list) -> str:
    """'send#3->r1 (1, 16, 64) torch.float32, recv#2<-r1': the batch's ops with their per-pair message numbers."""
    return ", ".join(
        f"{'send' if p['send'] else 'recv'}#{p['k']}{'->' if p['send'] else '<-'}r{p['peer']} "
        f"{_signature(p['op'].tensor)}"
        for p in plan
    )


def _state(store, rank: int) -> dict | None:
    key = f"{PREFIX}/state/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None


def find_cycle(store, me: int) -> list | None:
    """A cycle of blocked ranks through ``me``, each waiting on a key that the next has not written:
    [(rank, batch, batch description, key waited for), ...], or None. Depth-first over the published waits,
    each re-checked against the store (a key, once written, stays)."""
    states, path, seen = {}, [], set()

    def visit(rank: int) -> list | None:
        if rank not in states:
            states[rank] = _state(store, rank)
        st = states[rank]
        if st is None or not st["waits"]:
            return None
        seen.add(rank)
        for peer, key in st["waits"]:
            if store.check([key]):
                continue
            path.append((rank, st["batch"], st.get("desc", ""), key))
            if peer == me:
                return list(path)
            if peer not in seen:
                found = visit(peer)
                if found is not None:
                    return found
            path.pop()
        return None

    return visit(me)


def cycle_text(cycle: list) -> str:
    """'rank 1 batch 5 [send#2->r0 ..., recv#3<-r0 ...] waits for rank 0 to start its recv#2 of 1->0; ...'"""
    out = []
    for i, (rank, batch, desc, key) in enumerate(cycle):
        kind, pair, k = key.split("/")[-3:]
        out.append(
            f"rank {rank} batch {batch} [{desc}] waits for rank {cycle[(i + 1) % len(cycle)][0]} to start "
            f"its {kind}#{k} of {pair.replace('-', '->')}"
        )
    return "; ".join(out)


def install() -> None:
    """Replace batch_isend_irecv in this process (a forked rank) with NCCL's rules."""
    if getattr(dist.batch_isend_irecv, "nccl_rules", False):
        return
    rules = _Rules(dist.batch_isend_irecv)

    def batch_isend_irecv(p2p_op_list: list) -> list:
        return rules.batch(p2p_op_list)

    batch_isend_irecv.nccl_rules = True
    dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv
