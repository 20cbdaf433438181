"""Hang localisation across hosts (tests/hosts.py namespaces, one torchrun agent per host): the ranks post their
operation tails to the job's store (the first host's agent serves it), one rank on either host reads them all, and
the line names the rank stuck in its forward on the second host, by its host's address. The one-host cases (each
fault, each layout) are tests/trainer/test_hang.py's."""

from __future__ import annotations

import re
import time

from engine.trust.hang import EXIT_STATUS
from tests.cluster.hostjobs import torchrun_on_hosts, train_args

HANG_S = 3  # a step of the shrunk model across two namespaces takes well under a second


def test_hang_across_hosts_names_the_host(make_hosts, tmp_path):
    """tp 2 x pp 2 over two hosts (h1: stage 0, h2: stage 1): rank 2 sleeps in its step-3 forward; every rank ends
    within hang_timeout_s + 30 s of it with exit status 5 and one line naming rank 2 on h2 (its address)."""
    cluster, out = make_hosts(2), tmp_path / "run"
    args = train_args(out, "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.hang_timeout_s", str(HANG_S))
    args += ["--train.steps", "6"]
    started = time.monotonic()
    codes, output = torchrun_on_hosts(cluster, 2, args, tmp_path, env={"ENGINE_TEST_HANG": "sleep_forward:2:3"})
    lines = [line for line in output.splitlines() if "error: " in line]
    assert codes[0] != 0 and codes[1] != 0 and f"exitcode  : {EXIT_STATUS}" in output, output[-4000:]
    assert len(lines) == 1 and "error: hang at step 3: " in lines[0], output[-4000:]
    h2 = re.escape(cluster.hosts[1].addr)
    assert re.search(rf"rank 2 on host \S+ \({h2}\) never (entered|sent) it: rank 2 is in its forward", lines[0]), lines
    assert (out / "hang-3.json").exists()
    print(f"hang across hosts: ended {time.monotonic() - started:.0f} s after the launch")
