"""launch/bench/stage_balance.py (pp_layers auto against even): its arguments and one small run at pp 2. No timing
is asserted, only that both splits run side by side and every figure is produced."""

from __future__ import annotations

import math

import pytest

from launch.bench.stage_balance import SPLITS, parse_args, rank_main, report
from tests.dist import run_ranks


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--pp", "1"], "(1, 8)"),  # no pipeline
        (["--pp", "4", "--micro-batches", "2"], "(4, 2)"),  # m < pp
        (["--pp", "4", "--layers", "3"], "(4, 8)"),  # a stage without a layer
    ],
)
def test_bad_arguments_are_one_line_exit_2(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and names in err and "Traceback" not in err


@pytest.fixture(scope="module")
def measured():
    """pp 2, m 2, one measured step of a model whose head (4096 x 64) outweighs its 4 layers (a fixture: the forked
    ranks need the real stderr, which capsys replaces)."""
    args = parse_args(
        [
            "--pp",
            "2",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--ffn",
            "128",
            "--seq-len",
            "16",
            "--micro-batches",
            "2",
            "--steps",
            "1",
        ]
    )
    return args, run_ranks(rank_main, 2, args, timeout_s=120, threads=1)


def test_pp2_prints_auto_next_to_even(measured, capsys):
    args, ranks = measured
    report(2, 2, [r[2] for r in ranks], args)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [r[2] for r in rows] == list(SPLITS)
    even, auto = rows
    assert even[3:5] == ["[2,", "2]"] and auto[3:5] == ["[3,", "1]"]
    assert all(math.isfinite(float(x)) and float(x) > 0 for row in rows for x in row[5:])
