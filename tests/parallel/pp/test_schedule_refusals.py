"""Schedules that must be refused: the simulator (engine/parallel/pp/simulator.py) and the pipeline executor
(engine/parallel/pp/executor.py) check every rank's action list under NCCL's rules (rendezvous sends, one channel per
rank pair, one batch at a time in issue order) and refuse broken or deadlocking tables before anything runs; the
builders refuse bad arguments naming the value. Pure Python, no processes.
"""

from __future__ import annotations

import re

import pytest

from engine.parallel.pp.schedule import Action, Op, build, simulate, simulate_actions
from tests.parallel.pp.tables import computes, render_steps


def _broken(name: str, pp: int, m: int, v: int, stage: int, edit) -> list[list[Action]]:
    stages = [build(name, pp, m, s, v) for s in range(pp)]
    stages[stage] = edit(list(stages[stage]))
    return stages


def _swap(actions: list[Action], a: str, b: str) -> list[Action]:
    i, j = [i for i, x in enumerate(actions) if str(x) in (a, b)]
    actions[i], actions[j] = actions[j], actions[i]
    return actions


@pytest.mark.parametrize(
    "name,v,stage,edit,match",
    [
        (
            "zero_bubble",
            1,
            1,
            lambda x: [a for a in x if str(a) != "W2"],
            r"stage 1 micro-batch 2 chunk 0 ran fwd "
            r"bwd_input \(expected fwd bwd or fwd bwd_input bwd_weight\)",
        ),
        ("zero_bubble", 1, 1, lambda x: _swap(x, "B1", "W1"), r"stage 1 runs W1 after fwd of micro-batch 1"),
        (
            "zero_bubble",
            1,
            0,
            lambda x: x + [Action(Op.BWD_WEIGHT, 0)],
            r"stage 0 runs W0 after fwd bwd_input "
            r"bwd_weight",
        ),
        ("zero_bubble", 1, 3, lambda x: _swap(x, "B0", "sendB0"), r"stage 3 runs sendB0 before computing"),
        ("interleaved", 2, 0, lambda x: _swap(x, "recvF0.1", "F0.1"), r"stage 0 runs F0.1 before receiving"),
        (
            "interleaved",
            2,
            0,
            lambda x: _swap(x, "recvF0.1", "recvF1.1"),
            r"stage 0 recvF1.1 matched sendF0 of "
            r"stage 3",
        ),
        ("interleaved", 2, 3, lambda x: [a for a in x if str(a) != "recvB5"], r"stage 3 runs B5 before receiving"),
        ("interleaved", 2, 3, lambda x: x + [Action(Op.SEND_FWD, 0)], r"stage 3 sendF0 to stage 0 is never received"),
        (
            "interleaved",
            2,
            3,
            lambda x: x + [Action(Op.SEND_FWD, 0, 1)],
            r"stage 3 sendF0.1: no virtual stage 8 "
            r"\(valid: 0..7\)",
        ),
    ],
)
def test_simulator_refuses_broken_schedules(name, v, stage, edit, match):
    with pytest.raises(RuntimeError, match=match):
        simulate_actions(_broken(name, 4, 8, v, stage, edit))


def test_simulator_checks_the_chunk_of_each_message():
    """One rank, three chunks: chunk 0's output is for chunk 1, so chunk 2 taking it is an error (the tensor
    would feed the wrong layers), even though the channel and the micro-batch agree."""
    stage = [Action(Op.FWD, 0), Action(Op.SEND_FWD, 0), Action(Op.RECV_FWD, 0, 2), Action(Op.FWD, 0, 2)]
    with pytest.raises(RuntimeError, match=r"stage 0 recvF0.2 matched sendF0 of stage 0"):
        simulate_actions([stage + [Action(Op.FWD, 0, 1)]])


def test_simulator_keeps_one_channel_per_rank_pair():
    """At pp=2 the next and previous rank coincide: in rank 0's batch [sendF2 sendB0.1 recvB1.1] both sends go to
    rank 1 (F2 to its chunk 0, B0.1 to its chunk 0's backward), so rank 1 must receive them in that order; NCCL
    has no tags to sort them. Swapping the two sends on rank 0 alone is caught."""

    def edit(x: list[Action]) -> list[Action]:
        return _swap(x, "sendF2", "sendB0.1")

    stages = _broken("interleaved", 2, 4, 2, 0, edit)
    assert "[sendF2 sendB0 recvF3 recvB1]" in render_steps(stages[1])  # rank 1 takes F2 before B0.1's gradient
    with pytest.raises(RuntimeError, match=r"stage 1 recvF2 matched sendB0.1 of stage 0: the two post in different"):
        simulate_actions(stages)


def test_simulator_finds_the_deadlock_of_a_short_warmup(monkeypatch):
    """Rank 0 of pp=4, v=2, m=8 starting its backwards after 6 forwards instead of Megatron's 10: its batch
    receiving B0.1's gradient waits on rank 1's batch sending it, which rank 1 reaches only after forwards that
    need rank 0's F2.1, now behind that backward."""
    from engine.parallel.pp.schedules import interleaved

    megatron = interleaved.interleaved_warmup
    monkeypatch.setattr(interleaved, "interleaved_warmup", lambda pp, m, s, v: 6 if s == 0 else megatron(pp, m, s, v))
    stages = [build("interleaved", 4, 8, s, 2) for s in range(4)]
    with pytest.raises(
        RuntimeError,
        match=r"^deadlock: stage 0 in \[sendF1.1 recvF2.1 recvB0.1\]: recvB0.1 waits "
        r"for stage 1's sendB0.1 in its batch \[sendF4 sendB0.1 recvF5 recvB1.1\]; "
        r"stage 1 in \[sendF1.1 recvF2.1\]: recvF2.1 waits for stage 0's sendF2.1",
    ):
        simulate_actions(stages)


def old_interleaved(pp: int, m: int, stage: int, v: int) -> list[Action]:
    """The interleaved table before issue 24 (the fixture proving the simulator catches bug 2): Megatron's compute
    order, but each receive right before its compute and each send right after it."""
    from engine.parallel.pp.actions import backward_actions, forward_actions
    from engine.parallel.pp.schedules.interleaved import interleaved_order, interleaved_warmup

    order, warmup = interleaved_order(pp, m, v), interleaved_warmup(pp, m, stage, v)
    total = len(order)
    fwd = [forward_actions(pp, stage, mb, c, v) for mb, c in order]
    bwd = [backward_actions(pp, stage, mb, v - 1 - c, v) for mb, c in order]
    actions = [a for k in range(warmup) for a in fwd[k]]
    for k in range(total - warmup):
        actions += fwd[warmup + k] + bwd[k]
    return actions + [a for k in range(total - warmup, total) for a in bwd[k]]


def test_old_interleaved_order_deadlocks_under_nccl_rules():
    """Issue 24, bug 2: the old table has today's compute order and passes a buffered-send simulation, but under
    rendezvous sends and in-order batches pp=2, v=2, m=4 deadlocks exactly as the issue traces it: rank 1's
    [sendB1.1 recvF2] waits on rank 0's [sendF3 recvB1.1], queued behind [sendB0.1], which waits on rank 1's
    [sendF2 recvB0], queued behind the first. It deadlocks at every pp with m >= 2pp (v = 2, 3), never at m = pp;
    the new placement finishes all of them."""
    stages = [old_interleaved(2, 4, s, 2) for s in range(2)]
    assert [computes(x) for x in stages] == [computes(build("interleaved", 2, 4, s, 2)) for s in range(2)]
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "deadlock: stage 0 in [sendB0.1]: sendB0.1 waits for stage 1's recvB0 in its batch [sendF2 recvB0]; "
            "stage 1 in [sendB1.1 recvF2]: sendB1.1 waits for stage 0's recvB1.1 in its batch [sendF3 recvB1.1]"
        ),
    ):
        simulate_actions(stages)
    for pp in range(2, 9):
        for v in (2, 3):
            for m in (pp, 2 * pp, 3 * pp):
                old = [old_interleaved(pp, m, s, v) for s in range(pp)]
                if m >= 2 * pp:
                    with pytest.raises(RuntimeError, match="^deadlock: "):
                        simulate_actions(old)
                else:
                    simulate_actions(old)
                simulate("interleaved", pp, m, virtual_stages=v)


@pytest.mark.parametrize(
    "args,match",
    [
        (("interleaved", 4, 8, 0, 1), r"interleaved needs virtual_stages >= 2, got virtual_stages=1"),
        (("interleaved", 4, 6, 0, 2), r"multiple of pp.*micro_batches=6, pp=4; valid: 4, 8, \.\.\."),
        (("1f1b", 4, 8, 0, 2), r"virtual_stages=2 needs schedule 'interleaved'; 1f1b runs one"),
        (("zero_bubble", 4, 8, 0, 3), r"virtual_stages=3 needs schedule 'interleaved'"),
        (("zero_bubble", 4, 3, 0, 1), r"zero_bubble needs micro_batches >= pp.*micro_batches=3 < pp=4"),
    ],
)
def test_build_errors_for_new_schedules(args, match):
    with pytest.raises(ValueError, match=match):
        build(*args)


def test_executor_refuses_a_table_whose_ranks_post_in_different_orders(monkeypatch):
    """The executor simulates every rank's list before running: a table that would swap same-shaped messages
    (interleaved with the chunk and micro-batch loops swapped on one rank) fails at construction."""
    import types

    import torch

    from engine.parallel.pp import executor
    from engine.parallel.pp import schedule as sched_mod

    ctx = types.SimpleNamespace(pp=2, pp_rank=0)
    executor.PipelineExecutor(ctx, "interleaved", 4, (1, 2, 3), torch.float32, virtual_stages=2)  # the real one
    build = sched_mod.build

    def swapped(schedule, pp, m, stage, v=1):
        actions = build(schedule, pp, m, stage, v)
        if stage == 1:  # chunk before micro-batch: another order of the same actions
            actions = sorted(actions, key=lambda a: (a.op not in (Op.RECV_FWD, Op.FWD, Op.SEND_FWD), a.chunk, a.mb))
        return actions

    monkeypatch.setattr(sched_mod, "build", swapped)
    with pytest.raises(RuntimeError):
        executor.PipelineExecutor(ctx, "interleaved", 4, (1, 2, 3), torch.float32, virtual_stages=2)


def _hand(*names: str) -> list[Action]:
    """Computes written as the tables print them: "F1", "B0" (B of a split backward), "W0", "F0.1" (chunk 1)."""
    ops = {"F": Op.FWD, "B": Op.BWD_INPUT, "W": Op.BWD_WEIGHT}
    out = []
    for name in names:
        mb, _, chunk = name[1:].partition(".")
        out.append(Action(ops[name[0]], int(mb), int(chunk or 0)))
    return out


def test_executor_refuses_a_b_after_the_chunks_last_w(monkeypatch):
    """A chunk's last W is where the dp mode starts reducing its gradients (DDP.last_weight): a B of that chunk
    after it would add to gradients already in flight. Hand-made lists: chunk 0's B1 after W0, the chunk's last W
    (chunk 1's order is fine), refused by executor.last_weights. Through the executor the simulator refuses such a
    table first: every micro-batch's B precedes its own W there, so a B after a chunk's last W always breaks it."""
    import types

    import torch

    from engine.parallel.pp import executor
    from engine.parallel.pp import schedule as sched_mod

    good = _hand("F0", "F0.1", "F1", "B0.1", "B0", "W0.1", "B1", "W0", "W1")
    assert executor.last_weights(good, "zero_bubble") == {1: 0, 0: 1}
    for bad in (_hand("F0", "F1", "B0", "W0", "B1"), _hand("F0", "F0.1", "B0.1", "F1", "B0", "W0", "W0.1", "B1")):
        with pytest.raises(ValueError, match=r"^schedule zero_bubble: a B of chunk 0 follows its last W \(W0\)$"):
            executor.last_weights(bad, "zero_bubble")
    ctx = types.SimpleNamespace(pp=1, pp_rank=0)
    monkeypatch.setattr(sched_mod, "build", lambda *args: _hand("F0", "F1", "B0", "W1", "W0", "B1"))
    with pytest.raises(RuntimeError, match=r"runs W1 after fwd of micro-batch 1 chunk 0"):
        executor.PipelineExecutor(ctx, "zero_bubble", 2, (1, 2, 3), torch.float32, stage=torch.nn.Linear(2, 2))


def test_executor_refuses_the_old_interleaved_table_that_deadlocks_on_nccl(monkeypatch):
    """The executor's construction-time check is the NCCL model: fed the pre-issue-24 interleaved table (pp=2,
    v=2, m=4), which a buffered-send simulation passed, it refuses with the deadlock before anything runs."""
    import types

    import torch

    from engine.parallel.pp import executor
    from engine.parallel.pp import schedule as sched_mod

    ctx = types.SimpleNamespace(pp=2, pp_rank=0)
    monkeypatch.setattr(sched_mod, "build", lambda schedule, pp, m, stage, v=1: old_interleaved(pp, m, stage, v))
    with pytest.raises(RuntimeError, match=r"^deadlock: stage 0 in \[sendB0.1\]"):
        executor.PipelineExecutor(ctx, "interleaved", 4, (1, 2, 3), torch.float32, virtual_stages=2)
