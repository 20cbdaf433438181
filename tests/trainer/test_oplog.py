"""The operation log (engine/trust/oplog.py) in-process: the ring keeps the last SIZE records with their step and
schedule position, an operation that raised stays open, and ENGINE_TEST_HANG fires once, on its rank, from its step
on. The hang report that reads it runs through launch/pretrain.py in tests/trainer/test_hang.py."""

from __future__ import annotations

import pytest

from engine.trust import oplog
from engine.trust.oplog import OpLog, logged, parse_fault


def test_the_ring_keeps_the_last_records_oldest_first():
    log = OpLog(size=4)
    log.step, log.where = 7, ("F", 2, 1)
    ids = [log.begin("all_reduce", None, f"op{k}", nbytes=k, peer=k - 1) for k in range(6)]
    assert ids == list(range(6)) and log.n == 6
    log.end(5)
    log.end(0)  # overwritten by record 4: nothing to close, but it ended (progress)
    assert log.done == 2
    tail = log.tail()
    assert [r[0] for r in tail] == [2, 3, 4, 5] and log.tail(100) == tail
    assert tail[-1][1:10] == ["all_reduce", None, "op5", 4, 5, 7, "F", 2, 1]
    assert tail[-1][11] >= tail[-1][10] > 0 and [r[11] for r in tail[:-1]] == [0.0, 0.0, 0.0]  # only 5 closed
    assert [r[0] for r in log.tail(2)] == [4, 5] and OpLog().tail() == []
    tail[0][3] = "changed"  # a copy: the reader never edits the ring
    assert log.tail()[0][3] == "op2"
    short = OpLog(size=8)
    short.begin("send", None, "p2p")
    assert [r[0] for r in short.tail()] == [0]  # fewer records than the ring holds
    # an operation of unknown size, before the first step and outside any schedule (the start-up's, a run without
    # pipeline stages): 0 bytes, no peer, step 0, no action, micro-batch -1, chunk 0 in the hang table
    assert short.tail()[0][4:10] == [-1, 0, 0, "", -1, 0]


def test_an_operation_that_raised_stays_open(monkeypatch):
    log = OpLog()
    monkeypatch.setattr(oplog, "LOG", log)
    with logged("send", None, "p2p", 8, 3):
        pass
    with logged("all-reduce", None, "grad sync"):  # its size unknown (ddp's hook-driven sync): 0 bytes
        pass
    with pytest.raises(RuntimeError), logged("recv", None, "p2p", 8, 1):
        raise RuntimeError("peer gone")
    done, unsized, failed = log.tail()
    assert done[1:6] == ["send", None, "p2p", 3, 8] and done[11] > 0 and unsized[4:6] == [-1, 0]
    assert failed[1:6] == ["recv", None, "p2p", 1, 8] and failed[11] == 0.0 and log.done == 2


def test_the_fault_names_a_point_a_rank_and_a_step():
    assert parse_fault("wrong_peer:2:3", 2) == ("wrong_peer", 3)
    for text, rank in [("wrong_peer:2:3", 1), ("", 0), ("bogus:2:3", 2), ("wrong_peer:x:3", 2), ("wrong_peer:2", 2)]:
        assert parse_fault(text, rank) is None, text
    assert parse_fault("wrong_peer:2:3:4", 2) is None and parse_fault("sleep_forward:0:-1", 0) is None


def test_the_fault_fires_once_on_its_rank_from_its_step(monkeypatch):
    monkeypatch.setattr(oplog, "FAULT", None)
    monkeypatch.setattr(oplog.LOG, "step", 0)
    monkeypatch.setenv(oplog.FAULT_ENV, "skip_collective:1:3")
    oplog.arm(0)
    oplog.LOG.step = 5
    assert not oplog.fault("skip_collective")  # another rank's
    oplog.arm(1)
    fired = []
    for step in (2, 3, 4):
        oplog.LOG.step = step
        fired.append((oplog.fault("sleep_forward"), oplog.fault("skip_collective")))
    assert fired == [(False, False), (False, True), (False, False)]
    oplog.arm(1)  # a new start arms it again
    assert oplog.fault("skip_collective")
    monkeypatch.delenv(oplog.FAULT_ENV)
    oplog.arm(1)
    assert oplog.FAULT is None and not oplog.fault("skip_collective")


class _Lapped(list):
    """A ring whose slot ``at`` the main thread writes ``count`` more operations before the reader gets it: the
    thread switch that lets a rank still running (told of the hang by another) lap its ring under a ``tail``."""

    def __init__(self, log: OpLog, at: int, count: int):
        super().__init__(log.ring)
        self.log, self.at, self.count = log, at, count

    def __getitem__(self, slot):
        if slot == self.at and self.count:
            count, self.count = self.count, 0
            for _ in range(count):
                self.log.begin("send", None, "later")
        return super().__getitem__(slot)


def test_a_tail_taken_while_the_ring_is_lapped_stays_in_order():
    """A rank told of the hang by another may still be logging while its watchdog copies its tail: the records
    overwritten under the copy are left out, so the hang table lists the rank's operations oldest first, none twice,
    and none newer than the tail asked for (a newer one among older ones would read as the order it ran them)."""
    log = OpLog(size=4)
    for k in range(4):
        log.begin("recv", None, f"op{k}")
    log.ring = _Lapped(log, at=1, count=2)  # records 4 and 5 land in slots 0 and 1 as the copy reaches slot 1
    assert [r[0] for r in log.tail()] == [0, 2, 3] and log.n == 6
    assert [r[3] for r in log.tail()] == ["op2", "op3", "later", "later"]
