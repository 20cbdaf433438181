"""The single-process reference that a parallel layout is compared with, as one module-scoped fixture factory.

``one_process(base)`` is the reference of the MoE tests (tests/parallel/ep/test_ep.py, tests/parallel/cp/
test_moe_cp.py, tests/parallel/tp/test_moe_tp.py): one forked rank trains ``base`` once per module, through the
parity runner (tests/parity/runner.py run_group, initial weights included), and every test of the module compares
its layouts with that run (runner.assert_matches). The other references differ in what they run, so they stay
beside their tests:
- tests/cluster/jobs.py ``reference``: one node x 4 processes under torchrun (tp 2 x dp 2), the same job the
  two-node runs split over nodes, so only the node count differs;
- tests/cluster/test_launch.py ``reference``: a ``python launch/pretrain.py`` process of configs/tiny.yaml (3 steps),
  the one-process run of what the two launchers start;
- tests/cluster/test_hosts.py ``reference``: the records of one real process on this host (one_process), since the
  hosts' ranks are real processes too;
- tests/parallel/pp/test_pipeline.py ``reference``: pp 1 results per (micro-batches, tied) pair, computed lazily;
- tests/parallel/dp/test_zero.py ``reference``: a rank function (the plain trainer, parameters by HF name) run in
  the same set of forked ranks as the ZeRO runs, not a fixture.
"""

from __future__ import annotations

import pytest

from tests.parity import runner


def one_process(base: list[str]):
    """A module-scoped fixture: one process's run of ``base`` (runner.run_group's result of rank 0, with the
    initial weights), trained once into a temporary folder."""

    @pytest.fixture(scope="module")
    def reference(tmp_path_factory) -> dict:
        out = str(tmp_path_factory.mktemp("ref"))
        return runner.run_group(1, [[*base, "--train.out_dir", out]], want_init=True)[0][0]

    return reference
