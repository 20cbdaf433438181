"""Smoke test of launch/bench/cp.py: its table has a row per (seq, cp, mode), and the measured columns equal the
planned ones beside them (tests/planning/test_plan_cp.py and tests/parallel/cp/test_cp.py check the figures in more
cases)."""

from launch.bench.cp import HEADER, main


def test_table(capfd):
    assert main(["--seq-lens", "64", "--cp", "1", "2", "--repeats", "1", "--set", "model.num_layers=2"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0].split(" | ") == HEADER and len(lines) == 1 + 3  # cp 1; cp 2 ring and all_to_all
    for line in lines[1:]:
        cells = line.split(" | ")
        saved, planned, sent, planned_sent, wire, planned_wire = map(float, cells[3:9])
        assert abs(saved - planned) <= 1e-3 * planned and sent == planned_sent and wire == planned_wire, line
