"""launch/bench/schedules.py (1F1B, interleaved and zero bubble side by side): its arguments, its theory column
and its per-rank measurement, on a tiny model at pp = 2. No timing is asserted, only what the schedule tables
fix: activations in flight, that zero bubble's W queue is counted, that every figure is produced."""

from __future__ import annotations

import pytest

from launch.bench.schedules import NAMES, expected, parse_args, print_ops, print_stages, print_steps, rank_main, rotated
from tests.dist import run_ranks


def test_defaults_cover_the_issue_grid():
    args = parse_args([])
    assert (args.pp, args.micro_batches, args.virtual_stages, args.layers) == ([2, 4], [4, 8, 16], 2, 8)


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--pp", "4", "--micro-batches", "6"], "--micro-batches [6]"),  # interleaved needs m % pp == 0
        (["--pp", "4", "--micro-batches", "2"], "--micro-batches [2]"),  # m < pp
        (["--pp", "4", "--layers", "4"], "--layers 4"),  # 4 layers in pp*v = 8 chunks
        (["--virtual-stages", "1", "--layers", "8"], "--virtual-stages"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and names in err and "Traceback" not in err


def test_rotation_puts_each_schedule_in_each_position_once():
    orders = [rotated(NAMES, i) for i in range(len(NAMES))]
    assert all(sorted(o) == sorted(NAMES) for o in orders)
    assert all(len({o[pos] for o in orders}) == len(NAMES) for pos in range(len(NAMES)))


@pytest.mark.parametrize(
    "name, v, ops, closed",
    [
        ("1f1b", 1, {"F": 1.0, "B": 2.0}, 3 / 11),
        ("interleaved", 2, {"F": 0.5, "B": 1.0}, 3 / 19),
        # ZB-H1, W <= min(F, B) (exact there, schedules/zero_bubble.py): bubble (p-1)(F+B-W) = 9 over m(F+B+W) = 40 of
        # work
        ("zero_bubble", 1, {"F": 2.0, "Bi": 2.0, "W": 1.0}, 9 / 49),
        # ZB-V at F = B = W per chunk: rank r starts r chunk-F's late, (p-1)F = 3 over 2m(F+B+W) = 48 of work
        ("zbv", 2, {"F": 1.0, "Bi": 1.0, "W": 1.0}, 3 / 51),
    ],
)
def test_theory_at_pp4_m8(name, v, ops, closed):
    """The closed forms of the papers, and the simulator fed with the same uniform times agrees with them on
    every stage. 1F1B holds pp - stage micro-batches, ZB-H1 pp on every stage (until W: schedules/zero_bubble.py)."""
    t = expected(name, 4, 8, v, ops)
    assert t["closed"] == pytest.approx(closed)
    assert t["sim"] == pytest.approx([closed] * 4)
    if name != "interleaved":
        assert t["in_flight"] == {"1f1b": [4, 3, 2, 1], "zbv": [8, 8, 8, 8]}.get(name, [4, 4, 4, 4])


@pytest.fixture(scope="module")
def measured():
    """pp = 2, m = 2 and 4 on a tiny model, one measured step (a fixture: the forked ranks need the real
    stderr, which capsys replaces)."""
    args = parse_args(
        [
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "4",
            "--steps",
            "1",
            "--hidden",
            "32",
            "--ffn",
            "64",
            "--seq-len",
            "16",
            "--vocab",
            "64",
        ]
    )
    return args, run_ranks(rank_main, 2, args, timeout_s=120, threads=1)


def test_one_rank_pair_measures_every_schedule(measured):
    """Each schedule's summary has its figures, the in-flight counts are the schedule tables', the memory is
    measured, and zero bubble's last stage holds its W queue too."""
    _, ranks = measured
    for stage, r in enumerate(ranks):
        for m in (2, 4):
            got = r[m]
            assert set(got) == set(NAMES)
            assert got["1f1b"]["in_flight"] == 2 - stage and got["zero_bubble"]["in_flight"] == 2
            for s in got.values():
                assert len(s["steps"]) == 1 and s["step"] > 0 and 0 <= s["wait"] <= 1
                assert s["memory"][1] >= s["memory"][0] > 0
            for name, s in got.items():  # the loss on the rank of the last virtual stage (zbv: rank 0, its V)
                assert "F" in s["ops"] and set(s["ops"]) & {"B", "Bi"}
                assert ("L" in s["ops"]) == (stage == (0 if name == "zbv" else 1))
            assert "W" in got["zero_bubble"]["ops"] and "W" not in got["1f1b"]["ops"]
    last = ranks[1][4]["zero_bubble"]["memory"]
    assert last[1] > last[0]  # the x and g that W reads outlive B's saved tensors


def test_tables_print_a_row_per_setting(measured, capsys):
    """The three tables print a row per (m, schedule, stage), (m, schedule) and (m, schedule)."""  # 2 stages
    args, ranks = measured
    results = {2: ranks}
    print_stages(results, args)
    print_steps(results, args)
    print_ops(results, args)
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(" 2   4") for line in lines) == len(NAMES) * (2 + 1 + 1)
