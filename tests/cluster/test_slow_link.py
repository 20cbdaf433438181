"""A slow link at start-up (issue 42, item 6): one host of three behind 1 s of delay and 20 % loss (tests/slowlink.py,
netem's job done in user space where the kernel has no sch_netem). Mid-run such a link only slows the steps (a beat
is a write and a read); at start-up a rank's first beats are a connect and a round trip per peer more, so with the
heartbeat's own timeout the host was declared dead at step 0. The heartbeat gives its first
parallel.startup_timeout_s the start-up bound (engine/cluster/heartbeat.py ``_limit``), as joining does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests import hosts
from tests.cluster.hostjobs import LIMIT_S, start_agents, stop, train_args
from tests.cluster.jobs import records
from tests.slowlink import SlowLink

STEPS = 2  # the second one under the heartbeat's own timeout: the link mid-run


@pytest.mark.slow  # 3 minutes on 2 cores; tests/cluster/test_heartbeat_beats.py guards the allowance in CI
def test_slow_link_at_start_up_only_slows_the_job(make_hosts, tmp_path):
    """h3 behind the slow link from the start (1 s of delay; no loss here: at 20 % TCP moves a few KB/s and one
    step of even this model's gradients takes minutes, while the start-up verdict came from round trips alone), the
    heartbeat at 10 s: every agent exits 0 after every step, instead of h1 and h2 naming h3 silent at step 0."""
    if not Path("/dev/net/tun").exists():
        hosts.unavailable("needs /dev/net/tun (the slow link's TAP devices)")
    cluster = make_hosts(3)
    link = SlowLink(cluster, cluster.hosts[2], delay_s=1.0, loss=0.0)
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = train_args(out, "--train.steps", str(STEPS), "--train.global_batch_size", "12")  # dp 3
    args += ["--parallel.heartbeat_timeout_s", "10"]
    start = time.monotonic()
    procs = start_agents(cluster, 1, args, logs)
    try:
        codes = [p.wait(timeout=max(1.0, LIMIT_S - (time.monotonic() - start))) for p in procs]
    finally:
        stop(procs)
        link.close()
    text = "\n".join(p.read_text() for p in sorted(logs.glob("*.log")))
    errors = [x for x in text.splitlines() if x.startswith("error: ")]
    assert codes == [0, 0, 0] and not errors, (codes, errors)
    assert [r["step"] for r in records(out)] == list(range(1, STEPS + 1))
    print(f"h3 behind 1 s: {STEPS} steps in {time.monotonic() - start:.0f} s, {link.dropped} frames dropped")
