"""Fixtures of the cluster tests: the namespace hosts (tests/hosts.py), torchrun agents on loopback (jobs.py) and
the one-node run they are held against."""

from __future__ import annotations

import pytest

from tests import hosts
from tests.cluster.jobs import STEPS, Job, read_losses, train_args


@pytest.fixture
def make_hosts(tmp_path):
    """make_hosts(n, loopback=()) builds an n-host cluster, torn down after the test."""
    yield from hosts.make_hosts_fixture(tmp_path)


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.kill_all()


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[float]:
    """The losses of one node x 4 processes (tp 2 x dp 2), run once for the session: test_multinode's and
    test_faults' jobs are held against the same run."""
    out = tmp_path_factory.mktemp("one_node")
    j = Job(out)
    try:
        (code,) = j.wait(j.nodes(1, 4, train_args(out)))
        assert code == 0, j.output()[-3000:]
    finally:
        j.kill_all()
    losses = read_losses(out)
    assert len(losses) == STEPS
    return losses
