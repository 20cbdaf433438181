"""engine/parallel/layout/spawn.py's rank lifetime: ranks tear down their process group together (a rank that finished
first used to close its gloo connections while a peer was still in its last collective: "Connection reset by
peer"), and a rank that raised still fails the run at once, its traceback reaching the caller (not a peer's lost
connection), with its peers waiting in a collective or in that final barrier."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks

SLOW = 1.0  # seconds rank 1 works after rank 0 has returned


def _uneven_finish(out_dir: str) -> int:
    """Rank 1 returns SLOW s after rank 0; each rank records when its function ended and when its process group
    was destroyed (wrapping this forked rank's own destroy_process_group)."""
    rank = dist.get_rank()
    destroy = dist.destroy_process_group

    def recorded_destroy(*args, **kwargs):
        Path(out_dir, f"destroy{rank}").write_text(repr(time.time()))
        return destroy(*args, **kwargs)

    dist.destroy_process_group = recorded_destroy
    if rank == 1:
        time.sleep(SLOW)
    Path(out_dir, f"end{rank}").write_text(repr(time.time()))
    return rank


def test_no_rank_destroys_its_group_before_every_rank_finished(tmp_path):
    assert run_ranks(_uneven_finish, 2, str(tmp_path), timeout_s=60) == [0, 1]
    read = {p.name: float(p.read_text()) for p in tmp_path.iterdir()}
    assert read["destroy0"] >= read["end1"], read  # rank 0 waited for rank 1
    assert read["destroy1"] >= read["end1"], read


def _rank0_raises(where: str) -> None:
    if dist.get_rank() == 0:
        raise ValueError("rank 0 failed on purpose")
    if where == "collective":
        dist.all_reduce(torch.ones(1))  # waits for rank 0, which never comes
    # "barrier": rank 1 returns and waits for rank 0 in the final barrier


@pytest.mark.parametrize("where", ["collective", "barrier"])
def test_a_rank_that_raised_fails_the_run_at_once(where):
    """Its own traceback, not its peer's "Connection closed by peer" that follows (torch's join reports whichever
    failed rank it sees first: measured 1 run in 3 before run_ranks named the first failure). Several tries."""
    timeout_s = 60
    for _ in range(5):
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"^rank 0 failed first:\n(.|\n)*rank 0 failed on purpose"):
            run_ranks(_rank0_raises, 2, where, timeout_s=timeout_s)
        assert time.perf_counter() - start < timeout_s / 3  # not the process-group timeout
