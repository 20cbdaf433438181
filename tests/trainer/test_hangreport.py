"""The hang report's one line (engine/trust/hangreport.py ``diagnose``) from hand-made tails, in the shape
engine/trust/hang.py posts them: each case is a hang a real job can be in (tests/trainer/test_hang.py makes three of
them through launch/pretrain.py, at ~20 s each), here a pure call: who waits in what, and who never entered it."""

from __future__ import annotations

from engine.trust.hangreport import blocked_in, diagnose, members

WORLD = list(range(4))


def op(kind: str, what: str, *, step=3, group="world", ranks=None, peer=-1, action="", mb=-1, age=9.0, done=False):
    """One posted record: ``done`` operations ended (0.5 s after they began)."""
    rec = {"seq": 0, "kind": kind, "group": group, "ranks": ranks, "what": what, "peer": peer, "bytes": 4}
    rec |= {"step": step, "action": action, "mb": mb, "chunk": 0, "age_s": age, "open": not done}
    return rec | ({"took_s": 0.5} if done else {})


def tail(*ops: dict, step=3, action="", mb=-1, idle=None, host="h") -> dict:
    return {"host": host, "step": step, "where": {"action": action, "mb": mb, "chunk": 0}, "idle_s": idle, "ops": ops}


GRAD_SYNC = op("all-reduce", "grad sync", group="dp", ranks=WORLD)
FINISHED = op("all-reduce", "loss", group="dp", ranks=WORLD, done=True, age=7.0)


def test_ranks_that_never_entered_a_collective_are_named_with_what_they_do():
    """Ranks 0, 1 wait in the dp all-reduce; rank 2 computes a forward (its last operation ended), rank 3 posted a
    send before the backward it runs now (a send does not block a rank that went on): quiet since it posted it, 9 s
    (only the rank that saw the hang posts how long it saw no progress)."""
    tails = {r: tail(FINISHED, GRAD_SYNC, host="a") for r in (0, 1)}
    tails[2] = tail(FINISHED, action="fwd", mb=1, host="b")
    tails[3] = tail(FINISHED, op("send", "pipeline", peer=1, action="send_fwd", mb=0), action="bwd", mb=2, host="b")
    step, line = diagnose(tails, 4)
    assert step == 3
    assert line == (
        "error: hang at step 3: 2 of 4 ranks wait in communication; ranks 0, 1 on host a in all-reduce over dp (grad "
        "sync); ranks 2, 3 on host b never entered it: rank 2 is in its forward (micro-batch 1, action F) for 6 s, "
        "in no communication, rank 3 is in its backward (micro-batch 2, action B) for 9 s, in no communication"
    )


def test_a_collective_every_member_entered_is_a_link_or_device_fault():
    step, line = diagnose({r: tail(GRAD_SYNC) for r in WORLD}, 4)
    assert line == (
        "error: hang at step 3: 4 of 4 ranks wait in communication; ranks 0, 1, 2, 3 on host h in all-reduce over dp "
        "(grad sync): every member entered it and none left it (a link or device fault)"
    )


def test_a_rank_in_another_collective_of_the_same_group_never_entered_this_one():
    """Rank 1 skipped step 3's grad sync and waits in the grad norm's all-reduce: the same group, another purpose."""
    tails = {r: tail(GRAD_SYNC) for r in (0, 2, 3)}
    tails[1] = tail(op("all-reduce", "grad norm", group="dp", ranks=WORLD))
    assert diagnose(tails, 4)[1] == (
        "error: hang at step 3: 4 of 4 ranks wait in communication; ranks 0, 2, 3 on host h in all-reduce over dp "
        "(grad sync); rank 1 on host h never entered it (the ranks wait for each other in a cycle): rank 1 waits in "
        "all-reduce over dp (grad norm) for 9 s"
    )


def test_ranks_that_never_posted_are_named_missing():
    tails = {r: tail(GRAD_SYNC) for r in (0, 1)}
    assert diagnose(tails, 4)[1] == (
        "error: hang at step 3: 2 of 4 ranks wait in communication; ranks 0, 1 on host h in all-reduce over dp "
        "(grad sync); ranks 2, 3 on host an unknown host never posted their state (dead or frozen: see the heartbeat)"
    )


def test_a_receive_from_a_rank_that_never_sends():
    """Rank 2 receives from rank 1 over pp; rank 1 waits in nothing. Ranks 0, 3 wait at a later step (not reported)."""
    recv = op("recv", "pipeline", group="pp", ranks=[1, 2], peer=1, action="recv_fwd", mb=0, age=20.0)
    tails = {0: tail(op("all-reduce", "loss", step=4, ranks=WORLD, group="dp"), step=4), 1: tail(FINISHED)}
    tails |= {2: tail(recv), 3: tail(op("all-reduce", "loss", step=4, ranks=WORLD, group="dp"), step=4)}
    step, line = diagnose(tails, 4)
    assert step == 3
    assert line == (
        "error: hang at step 3: 3 of 4 ranks wait in communication; rank 2 on host h in recv from rank 1 over pp "
        "(micro-batch 0, action recv F); rank 1 on host h never sent it: rank 1 is outside the pipeline schedule for "
        "6 s, in no communication"
    )


def test_a_send_nobody_receives_and_a_pair_of_receives_that_wait_for_each_other():
    """Rank 0's send to rank 1 (it still runs that send's action) is never received: rank 1 computes. Then ranks 0
    and 1 receive from each other: a cycle, reported from its earliest operation (micro-batch 1)."""
    send = op("send", "pipeline", group="pp", ranks=[0, 1], peer=1, action="send_bwd", mb=3)
    tails = {0: tail(send, action="send_bwd", mb=3), 1: tail(FINISHED, action="bwd_weight", mb=2, idle=3.0)}
    assert diagnose(tails, 2)[1] == (
        "error: hang at step 3: 1 of 2 ranks wait in communication; rank 0 on host h in send to rank 1 over pp "
        "(micro-batch 3, action send B); rank 1 on host h never received it: rank 1 is in its weight backward "
        "(micro-batch 2, action W) for 3 s, in no communication"
    )
    tails = {0: tail(op("recv", "pipeline", group="pp", peer=1, action="recv_bwd", mb=2, age=5.0))}
    tails[1] = tail(op("recv", "pipeline", group="pp", peer=0, action="recv_fwd", mb=1, age=8.0))
    assert diagnose(tails, 2)[1].endswith(
        " on host h in recv from rank 0 over pp (micro-batch 1, action recv F); rank 0 on host h never sent it (the "
        "ranks wait for each other in a cycle): rank 0 waits in recv from rank 1 over pp (micro-batch 2, action recv "
        "B) for 5 s"
    )


def test_the_earliest_operation_is_reported_step_then_phase_then_micro_batch():
    """Every rank waits for a rank that never entered its collective; the report starts from the earliest one."""
    loss = op("all-reduce", "loss", group="dp", ranks=[0, 1])
    norm = op("all-reduce", "grad norm", group="mp", ranks=[2, 3])
    tails = {0: tail(loss), 1: tail(FINISHED), 2: tail(norm), 3: tail(FINISHED)}
    assert (
        " ranks wait in communication; rank 0 on host h in all-reduce over dp (loss); rank 1 " in diagnose(tails, 4)[1]
    )
    tails[2] = tail(op("all-reduce", "loss", step=2, group="mp", ranks=[2, 3]), step=2)  # an earlier step
    step, line = diagnose(tails, 4)
    assert step == 2 and "; rank 2 on host h in all-reduce over mp (loss); rank 3 " in line, line
    first = op("recv", "pipeline", group="pp", ranks=[1, 2], peer=1, action="recv_fwd", mb=0, age=2.0)
    later = op("recv", "pipeline", group="pp", ranks=[0, 3], peer=3, action="recv_fwd", mb=1, age=30.0)
    tails = {0: tail(later), 1: tail(FINISHED), 2: tail(first), 3: tail(FINISHED)}
    assert "; rank 2 on host h in recv from rank 1 over pp (micro-batch 0, " in diagnose(tails, 4)[1]
    tails[0] = tail(op("recv", "pipeline", group="pp", ranks=[0, 3], peer=3, action="recv_fwd", mb=0, age=30.0))
    assert "; rank 0 on host h in recv from rank 3 over pp (micro-batch 0, " in diagnose(tails, 4)[1]  # longest


def test_of_two_phases_of_a_step_the_earlier_is_reported():
    """For each two consecutive phases of a step (data, schedule, loss, tied embedding, grad sync, grad norm, step
    stats, stop signal, then anything else), rank 2 waits in the earlier one and rank 0 in the later one, which a
    lower micro-batch and a longer wait would put first if the phases tied."""
    phases = ["data", "pipeline", "loss", "tied embedding", "grad sync", "grad norm", "step stats", "stop signal", "?"]
    for earlier, later in [*zip(phases, phases[1:]), ("data", "layer"), ("layer", "loss")]:  # a layer's: schedule
        tails = {0: tail(op("all-reduce", later, group="dp", ranks=[0, 1], mb=-1, age=50.0)), 1: tail(FINISHED)}
        tails |= {2: tail(op("all-reduce", earlier, group="mp", ranks=[2, 3], mb=5, age=1.0)), 3: tail(FINISHED)}
        assert "; rank 2 on host h in all-reduce over mp" in diagnose(tails, 4)[1], (earlier, later)


def test_the_line_tells_what_four_of_the_ranks_that_never_entered_do():
    tails = {0: tail(op("all-reduce", "loss", ranks=list(range(6))))} | {r: tail(FINISHED) for r in range(1, 6)}
    line = diagnose(tails, 6)[1]
    assert "; ranks 1, 2, 3, 4, 5 on host h never entered it: rank 1 is outside" in line, line
    assert [f"rank {r} is outside the pipeline schedule" in line for r in range(1, 6)] == [True] * 4 + [False]


def test_the_walk_follows_the_first_peer_that_waits_elsewhere():
    """Rank 0 waits in an all-reduce that ranks 1 and 2 never entered: both wait in receives of the next step, from
    ranks 3 and 4, which compute. The walk goes on from rank 1, the first of them."""
    tails = {0: tail(op("all-reduce", "loss", group="dp", ranks=[0, 1, 2]))}
    for r, peer in ((1, 3), (2, 4)):
        tails[r] = tail(op("recv", "pipeline", step=4, group="pp", ranks=[r, peer], peer=peer, action="recv_fwd", mb=0))
    tails |= {3: tail(FINISHED), 4: tail(FINISHED)}
    assert (
        "; rank 1 on host h in recv from rank 3 over pp (micro-batch 0, action recv F); rank 3 "
        in diagnose(tails, 5)[1]
    )


def test_a_job_with_no_rank_in_communication_lists_what_each_does():
    tails = {r: tail(FINISHED, step=5 + (r == 2), action="fwd", mb=r) for r in range(6)}
    step, line = diagnose(tails, 6)
    assert step == 6
    assert line == (
        "error: hang at step 6: 0 of 6 ranks wait in communication; rank 0 is in its forward (micro-batch 0, action "
        "F) for 6 s, in no communication; rank 1 is in its forward (micro-batch 1, action F) for 6 s, in no "
        "communication; rank 2 is in its forward (micro-batch 2, action F) for 6 s, in no communication; rank 3 is in "
        "its forward (micro-batch 3, action F) for 6 s, in no communication"
    )
    assert diagnose({0: tail(step=1)}, 1)[1] == (
        "error: hang at step 1: 0 of 1 ranks wait in communication; rank 0 is outside the pipeline schedule, in no "
        "communication"
    )


def test_a_group_posted_as_a_range_or_unnamed_is_read_back_as_its_ranks():
    """hang.py posts an evenly spaced group as ["range", start, stop, step]; a group it has no name for by its
    ranks. Rank 6, a member, computes; rank 1, not a member, waits in nothing and is not blamed."""
    assert members({"ranks": ["range", 0, 8, 2]}, 8) == [0, 2, 4, 6]
    assert members({"ranks": None}, 3) == [0, 1, 2] and members({"ranks": [5, 1]}, 8) == [5, 1]
    reduce = op("all-reduce", "grad sync", group="group", ranks=["range", 0, 8, 2])
    tails = {r: tail(reduce) for r in (0, 2, 4)} | {r: tail(FINISHED) for r in (1, 3, 5, 6, 7)}
    assert diagnose(tails, 8)[1] == (
        "error: hang at step 3: 3 of 8 ranks wait in communication; ranks 0, 2, 4 on host h in all-reduce over ranks "
        "0, 2, 4, 6 (grad sync); rank 6 on host h never entered it: rank 6 is outside the pipeline schedule for 6 s, "
        "in no communication"
    )


def test_what_counts_as_blocked():
    assert blocked_in(tail()) is None and blocked_in({"ops": []}) is None
    assert blocked_in(tail(FINISHED)) is None and blocked_in(tail(GRAD_SYNC)) == GRAD_SYNC
    send = op("send", "pipeline", peer=1, action="send_fwd", mb=2)
    assert blocked_in(tail(send, action="send_fwd", mb=2)) == send  # still in the send's action: waits in it
    assert (
        blocked_in(tail(send, action="send_fwd", mb=3)) is None and blocked_in(tail(send, action="fwd", mb=2)) is None
    )


def test_receives_from_different_peers_are_not_one_operation():
    """Ranks 2 and 3 both wait in step 3's pipeline receive with no group ranks posted (ranks None), rank 2 from
    rank 1 and rank 3 from rank 0: the line names only the rank in the receive it reports, from its peer (the key
    once left the peer out and said "ranks 2, 3 ... in recv from rank 1")."""
    tails = {r: tail(op("all-reduce", "loss", step=4, ranks=WORLD, group="dp"), step=4) for r in (0, 1)}
    tails[2] = tail(op("recv", "pipeline", group="pp", peer=1, action="recv_fwd", mb=0, age=20.0))
    tails[3] = tail(op("recv", "pipeline", group="pp", peer=0, action="recv_fwd", mb=0, age=10.0))
    line = diagnose(tails, 4)[1]
    assert "; rank 2 on host h in recv from rank 1 over pp (micro-batch 0, action recv F); rank 1 " in line, line
