"""The link test's plan and its numbers (engine/cluster/linktest.py) in seconds: the rounds of pairs as functions, the
measurement on three forked gloo ranks with a clock that counts messages: it reads 4 (rank + 1) seconds per message
the rank has sent (send, all-reduce) so far, so each bandwidth is the bytes the test moved over the messages it timed,
whatever the machine's load (a warm-up round timed, a round too many or too few, or a pair timed on its other rank
all change the figure; 4, not 1, so that a product is not a quotient). tests/cluster/test_preflight.py runs it
through launch/preflight.py (--local, and two hosts over a fake ssh)."""

from __future__ import annotations

import types
from itertools import combinations

import torch

from engine.cluster import linktest
from tests.dist import run_ranks


def _check_rounds(rounds: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Every round's pairs share no rank, each pair is (low, high); the pairs of all rounds, in order."""
    for pairs in rounds:
        ranks = [r for pair in pairs for r in pair]
        assert len(ranks) == len(set(ranks)) and all(a < b for a, b in pairs), pairs
    return [pair for pairs in rounds for pair in pairs]


def test_up_to_max_all_ranks_every_pair_is_measured_once_in_n_minus_1_rounds():
    assert linktest.link_rounds(["a"]) == [] and linktest.link_rounds([]) == []
    for n in range(2, 10):
        rounds = linktest.link_rounds([f"h{r}" for r in range(n)])
        assert len(rounds) == (n - 1 if n % 2 == 0 else n) and all(len(pairs) == n // 2 for pairs in rounds)
        pairs = _check_rounds(rounds)
        assert sorted(pairs) == list(combinations(range(n), 2)), n  # each pair once
    sixteen = [f"h{r}" for r in range(16)]  # 16 ranks: still every pair
    assert len(linktest.link_rounds(sixteen)) == 15 and linktest.link_pairs(sixteen) == list(combinations(range(16), 2))
    seventeen = [(0, r) for r in range(1, 17)]  # 17 (the README's "beyond 16 ranks"): the first rank's local links
    assert (
        linktest.link_rounds(["a"] * 17) == [[pair] for pair in seventeen]
        and linktest.link_pairs(["a"] * 17) == seventeen
    )
    assert linktest.link_pairs(["a"] * 5, max_all=4) == [(0, 1), (0, 2), (0, 3), (0, 4)]  # one host: its local links


def test_beyond_max_all_each_hosts_first_rank_meets_its_local_ranks_then_other_hosts():
    labels = ["a"] * 4 + ["b"] * 2 + ["c"] + ["d"] * 3 + ["e"] * 4  # 14 ranks, uneven hosts
    rounds = linktest.link_rounds(labels, max_all=8)
    assert rounds[:3] == [[(0, 1), (4, 5), (7, 8), (10, 11)], [(0, 2), (7, 9), (10, 12)], [(0, 3), (10, 13)]]
    leaders = [0, 4, 6, 7, 10]
    host_pairs = _check_rounds(rounds[3:])
    assert len(rounds) == 3 + 4 and all(a in leaders and b in leaders for a, b in host_pairs)
    assert len(host_pairs) == len(set(host_pairs)) == 4 * (5 // 2)  # 4 rounds, a host resting in each
    assert len(linktest.link_rounds(labels, max_all=8, host_rounds=9)) == 3 + 5  # 5 hosts: 5 rounds hold every pair
    two = linktest.link_rounds(["a"] * 9 + ["b"] * 9, max_all=16)
    assert two[-1] == [(0, 9)] and len(two) == 8 + 1  # two hosts: one round holds their only pair


def test_the_plan_counts_rounds_pairs_and_the_serial_plan_of_before():
    lines, seconds = linktest.plan_lines(4, 8, 0.5)
    assert lines == [
        "link test: 34 pairs in 10 rounds of disjoint pairs (pairs per round: 2 to 4), 4 hosts x 8 ranks",
        "link test estimate: 10 rounds x 0.500 s = 5.0 s (serial pairs, as before: 34 x 0.500 s = 17.0 s)",
    ]
    assert seconds == 5.0  # 7 rounds of local pairs, then 3 hold every pair of the 4 hosts
    lines, seconds = linktest.plan_lines(2, 2, 1.0, host_rounds=1)
    assert lines[1] == "link test estimate: 3 rounds x 1.000 s = 3.0 s (serial pairs, as before: 6 x 1.000 s = 6.0 s)"
    assert linktest.plan_lines(4, 4, 1.0)[0][1].endswith("(serial pairs, as before: 120 x 1.000 s = 120.0 s)")
    assert linktest.plan_lines(1, 17, 1.0)[0] == [  # beyond 16 ranks, and so was the serial plan
        "link test: 16 pairs in 16 rounds of disjoint pairs (pairs per round: 1 to 1), 1 hosts x 17 ranks",
        "link test estimate: 16 rounds x 1.000 s = 16.0 s (serial pairs, as before: 16 x 1.000 s = 16.0 s)",
    ]
    assert linktest.plan_lines(1, 1, 1.0)[0][0].startswith(
        "link test: 0 pairs in 0 rounds of disjoint pairs (pairs per round: 0 to 0)"
    )


def _measure(size_bytes: int, iters: int):
    """One rank of the link test, its clock reading 4 (rank + 1) seconds per message sent so far (linktest's only)."""
    real, rank, sent = torch.distributed, torch.distributed.get_rank(), [0]

    def counted(op):
        def call(*args, **kwargs):
            sent[0] += 1
            return op(*args, **kwargs)

        return call

    linktest.dist = types.SimpleNamespace(
        **{**vars(real), "send": counted(real.send), "all_reduce": counted(real.all_reduce)}
    )
    linktest.time = types.SimpleNamespace(perf_counter=lambda: 4.0 * (rank + 1) * sent[0])
    return linktest.measure(f"host{rank // 2}", size_bytes, iters, torch.device("cpu"))


def test_three_ranks_measure_every_link_and_rank_0_reports_the_bandwidths():
    reports = run_ranks(_measure, 3, 4000, 3)
    assert reports[1:] == [None, None]
    r = reports[0]
    assert (r.labels, r.size_bytes, r.backend) == (["host0", "host0", "host1"], 4000, "gloo")
    # a ping-pong timed on the pair's first rank, after its warm-up round: 2 x 3 messages of 4,000 bytes in the
    # 3 sends' time, 4 (a + 1) s each; the all-reduce on rank 0 (after its warm-up): 3 of 4,000 bytes in 3 x 4 s
    assert r.p2p == [(0, 1, 24000 / 12 / 1e9), (0, 2, 24000 / 12 / 1e9), (1, 2, 24000 / 24 / 1e9)]
    assert r.allreduce_algbw == 12000 / 12 / 1e9 and r.allreduce_busbw == 12000 / 12 / 1e9 * 2 * 2 / 3
    assert linktest.format_report(r).splitlines() == [
        "links (gloo, 0.0 MiB messages, 3 ranks):",
        "  p2p rank 0 (host0) <-> rank 1 (host0):     0.00 GB/s",
        "  p2p rank 0 (host0) <-> rank 2 (host1):     0.00 GB/s",
        "  p2p rank 1 (host0) <-> rank 2 (host1):     0.00 GB/s",
        "  all-reduce over 3 ranks: algbw     0.00 GB/s, busbw     0.00 GB/s",
    ]
    one = run_ranks(_measure, 1, 2, 1)[0]  # under 4 bytes: one float all the same
    assert (one.size_bytes, one.p2p, one.allreduce_busbw) == (4, [], 0.0) and one.allreduce_algbw == 1 / 1e9
    two = run_ranks(_measure, 2, 8, 1)[0]  # two ranks: a ring all-reduce's links carry what each rank holds
    assert two.p2p == [(0, 1, 16 / 4 / 1e9)] and two.allreduce_busbw == two.allreduce_algbw == 8 / 4 / 1e9


def test_the_report_names_each_pair_its_figure_and_the_message_size():
    report = linktest.LinkReport(["n0", "n0", "n1"], 3 * 2**20, "nccl", [(0, 1, 181.5), (0, 2, 11.25)], 90.0, 120.0)
    assert linktest.format_report(report).splitlines() == [
        "links (nccl, 3.0 MiB messages, 3 ranks):",
        "  p2p rank 0 (n0) <-> rank 1 (n0):   181.50 GB/s",
        "  p2p rank 0 (n0) <-> rank 2 (n1):    11.25 GB/s",
        "  all-reduce over 3 ranks: algbw    90.00 GB/s, busbw   120.00 GB/s",
    ]
