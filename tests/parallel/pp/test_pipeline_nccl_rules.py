"""Issue 24: pipelines under NCCL's point-to-point rules (tests/nccl_shim.py over gloo).

The shim itself (one Work per batch, rendezvous sends, in-order batches, shape check, fast deadlock error), then
every schedule at pp 2 and 4 with m = pp, 2pp and 3pp micro-batches trained under it against one process, within
the parity matrix's fp32 bounds (tests/parity/runner.py). The CI subset is every schedule at pp 2, m = 2pp, and
1F1B at pp 4, m = 3pp; the rest is marked slow. Plus 1F1B on plain gloo (a Work per op): the executor takes both.

Bug 1 of the issue (Works zipped with ops) fails 1f1b-v1-pp2-m4 with KeyError (1, 0) on the last stage (its first
received activation dropped); bug 2 (interleaved order) fails interleaved-v2-pp2-m4 and -v3- with "NCCL rules:
deadlock: rank 1 batch 5 [send#3->r0 ..., recv#4<-r0 ...] waits for rank 0 to start its recv#3 of 1->0; rank 0
batch 6 [send#5->r1 ...] waits for rank 1 to start its recv#5 of 0->1" about 2 s into the run.

    python -m pytest -q tests/parallel/pp/test_pipeline_nccl_rules.py              # CI subset
    python -m pytest -q -m slow tests/parallel/pp/test_pipeline_nccl_rules.py      # the rest
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks
from tests.nccl_shim import BatchWork
from tests.parity import runner
from tests.parity.matrix import Combo


def _batch(ops: list[tuple[str, torch.Tensor, int]]) -> list:
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer) for kind, t, peer in ops]
    )


def _outcome(fn):
    """Run fn; return ("ok", its value, seconds) or (error type, message, seconds)."""
    start = time.monotonic()
    try:
        value = fn()
        return "ok", value, time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e), time.monotonic() - start


def _exchange() -> tuple:
    """Rank function: one batch [send mine, receive the other's] between ranks 0 and 1."""
    me, other = dist.get_rank(), 1 - dist.get_rank()
    got = torch.zeros(3)
    works = _batch([("send", torch.full((3,), float(me)), other), ("recv", got, other)])
    for w in works:
        w.wait()
    return len(works), type(works[0]).__name__, got.tolist()


def test_one_work_per_batch_and_data_delivered():
    for me, (n, kind, got) in enumerate(run_ranks(_exchange, 2)):
        assert (n, kind) == (1, BatchWork.__name__)
        assert got == [float(1 - me)] * 3


def test_gloo_without_the_shim_returns_one_work_per_op():
    """What makes the zip bug invisible on plain gloo: the control for the test above."""
    assert [r[0] for r in run_ranks(_exchange, 2, nccl_rules=False)] == [2, 2]


def _late_receiver(delay: float) -> tuple:
    """Rank 0 sends alone; rank 1 posts the receive only after ``delay`` seconds."""
    if dist.get_rank() == 0:
        return _outcome(lambda: _batch([("send", torch.ones(2), 1)]))[2]
    time.sleep(delay)
    got = torch.zeros(2)
    _batch([("recv", got, 0)])
    return got.tolist()


def test_send_completes_only_when_the_receiver_starts():
    waited, got = run_ranks(_late_receiver, 2, 1.5)
    assert got == [1.0, 1.0]
    assert waited >= 1.4, f"the send returned after {waited:.2f} s, before its receiver's batch started"


def _unmatched_send() -> tuple:
    if dist.get_rank() == 0:
        return _outcome(lambda: _batch([("send", torch.ones(2), 1)]))
    return None  # never receives


def test_send_never_received_fails_within_seconds(monkeypatch):
    monkeypatch.setenv("ENGINE_NCCL_SHIM_TIMEOUT_S", "2")
    kind, message, seconds = run_ranks(_unmatched_send, 2, timeout_s=60)[0]
    assert kind == "NcclRulesError" and "NCCL rules" in message and "recv/0-1/0" in message, message
    assert seconds < 10


def _crossed(first: str) -> tuple:
    """Both ranks run two batches, [send] then [recv] (or [recv] then [send]), waiting only for receives, as the
    executor does: fine on gloo, where a send-only batch does not hold up the next; a deadlock under NCCL's
    rendezvous sends and in-order batches."""
    other = 1 - dist.get_rank()

    def both():
        order = [("send", torch.ones(2), other), ("recv", torch.zeros(2), other)]
        sends = []
        for op in order if first == "send" else order[::-1]:
            works = _batch([op])
            if op[0] == "recv":
                for w in works:
                    w.wait()
            else:
                sends += works
        for w in sends:
            w.wait()

    return _outcome(both)


@pytest.mark.parametrize("first", ["send", "recv"])
def test_crossed_batches_deadlock_within_seconds(first):
    for kind, message, seconds in run_ranks(_crossed, 2, first, timeout_s=60):
        assert kind == "NcclRulesError" and "NCCL rules: deadlock" in message, message
        assert seconds < 10, f"deadlock found after {seconds:.1f} s"
    assert run_ranks(_crossed, 2, "send", nccl_rules=False)[0][0] == "ok"  # gloo alone lets it through


def _fifo() -> list:
    """Rank 0 sends 1 then 2 in two batches; rank 1 receives both in one batch: matched in posting order."""
    if dist.get_rank() == 0:
        _batch([("send", torch.tensor([1.0]), 1)])
        _batch([("send", torch.tensor([2.0]), 1)])
        return []
    a, b = torch.zeros(1), torch.zeros(1)
    _batch([("recv", a, 0), ("recv", b, 0)])
    return [a.item(), b.item()]


def test_messages_of_a_pair_match_in_posting_order():
    assert run_ranks(_fifo, 2)[1] == [1.0, 2.0]


def _mismatch() -> tuple:
    if dist.get_rank() == 0:
        return _outcome(lambda: _batch([("send", torch.ones(4), 1)]))
    return _outcome(lambda: _batch([("recv", torch.zeros(2, dtype=torch.bfloat16), 0)]))


def test_send_of_another_shape_or_dtype_is_refused(monkeypatch):
    monkeypatch.setenv("ENGINE_NCCL_SHIM_TIMEOUT_S", "3")  # the receiver then gives up waiting
    kind, message, _ = run_ranks(_mismatch, 2, timeout_s=60)[0]
    assert kind == "NcclRulesError", message
    assert "(4,) torch.float32" in message and "expects (2,) torch.bfloat16" in message, message


# Every schedule trained under the shim against one process. Interleaved with v chunks (zbv: 2) needs pp * v | layers.
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3), ("zero_bubble", 1), ("zbv", 2)]
CI = {(s, v, 2, 4) for s, v in SCHEDULES} | {("1f1b", 1, 4, 12)}
CASES = [(s, v, pp, m) for s, v in SCHEDULES for pp in (2, 4) for m in (pp, 2 * pp, 3 * pp)]
_references: dict = {}


def _layers(pp: int, v: int) -> int:
    return 4 if v == 1 else pp * v


def _argv(c: Combo, root, m: int, v: int) -> list[str]:
    return runner.combo_argv(
        c,
        f"{root}/{c.name}-m{m}",
        "--train.global_batch_size",
        str(m),
        *(["--parallel.virtual_stages", str(v)] if v > 1 else []),
    )


@pytest.mark.parametrize(
    "schedule,v,pp,m",
    [
        pytest.param(
            *case, id=f"{case[0]}-v{case[1]}-pp{case[2]}-m{case[3]}", marks=() if case in CI else pytest.mark.slow
        )
        for case in CASES
    ],
)
def test_schedule_under_nccl_rules_matches_single_process(tmp_path_factory, schedule, v, pp, m):
    _assert_matches_single_process(tmp_path_factory, schedule, v, pp, m)


def test_executor_also_takes_one_work_per_op(tmp_path_factory, monkeypatch):
    """Plain gloo (the shim off) returns a Work per op: the executor waits any number of them."""
    monkeypatch.setenv("ENGINE_NCCL_SHIM", "0")
    _assert_matches_single_process(tmp_path_factory, "1f1b", 1, 2, 4)


def _assert_matches_single_process(tmp_path_factory, schedule: str, v: int, pp: int, m: int) -> None:
    layers = _layers(pp, v)
    if (layers, m) not in _references:
        ref = Combo(1, 1, 1, "ddp", "-", "fp32", False, False, False, layers=layers)
        _references[layers, m] = runner.run_group(
            1, [_argv(ref, tmp_path_factory.mktemp("ref"), m, 1)], want_init=True
        )[0][0]
    combo = Combo(1, pp, 1, "ddp", schedule, "fp32", False, False, False, layers=layers)
    (run,) = runner.run_group(pp, [_argv(combo, tmp_path_factory.mktemp("pp"), m, v)])
    runner.assert_matches(run, _references[layers, m], combo.name)
