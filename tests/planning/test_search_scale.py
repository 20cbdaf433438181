"""The pruned layout search (engine/planning/search.py ``search(..., top=k)``, what launch/plan.py runs for its
table): the same best layouts as the exhaustive search, bit for bit (tests/planning/data/search_best.json, made by
tests/planning/search_fixture.py from the search before the pruning), and at 16,384 devices a count of the layouts
it plans in full, where the exhaustive search planned every valid one (issue 43)."""

import json
import runpy

import pytest

from engine.planning.schedules import SEARCHED
from engine.planning.search import Hardware, compute_bound, lower_bound, search, worst_stage
from tests.cli import ROOT, run_script
from tests.planning.models import tiny
from tests.planning.search_fixture import TOP, case_config, case_hardware

FIXTURE = json.loads((ROOT / "tests" / "planning" / "data" / "search_best.json").read_text())


@pytest.mark.parametrize("case", FIXTURE, ids=lambda c: f"{c['case'][0].split('/')[-1]}-{c['case'][1]}-{c['case'][2]}")
def test_search_finds_the_exhaustive_searchs_best(case):
    """The pruned search's 15 best are the exhaustive search's, every figure bit for bit."""
    config, world, memory, overrides = case["case"]
    cfg = case_config(config, overrides)
    counts = {}
    plans = search(cfg, world, case_hardware(cfg, memory), SEARCHED, top=TOP, counts=counts)
    assert [p.describe() for p in plans] == case["best"]
    assert counts["planned"] < counts["valid"] / 10, counts  # the exhaustive search planned every valid one


def test_plan_table_is_the_exhaustive_searchs_best():
    """launch/plan.py's table (its default --top 15) lists the rows the exhaustive search put first."""
    (case,) = [c for c in FIXTURE if c["case"][0] == "configs/tiny.yaml"]
    config, world, memory, overrides = case["case"]
    # the fixture's hardware: Hardware()'s efficiency and no element-wise kernels priced (plan.py's defaults are
    # the --device kind's and part's, devices.py)
    efficiency = ["--efficiency", str(Hardware().efficiency), "--hbm-gbps", "0"]
    run = run_script(
        "launch/plan.py", "--config", config, "--world-size", world, "--device-memory", memory, *efficiency, *overrides
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    table = runpy.run_path(str(ROOT / "launch" / "plan.py"))["table"]  # not as __main__: its table() alone
    assert lines[1:] == table(case["best"]).splitlines()
    assert lines[0].endswith("4491 valid layouts, 55 planned in full, the fastest that fit below"), lines[0]


def test_lower_bound_holds_for_every_layout():
    """No layout's step time is below its lower bound (what lets the pruned search skip the rest)."""
    plans = search(tiny(), 4, Hardware(), SEARCHED)
    assert len(plans) > 500
    for p in plans:
        bound = lower_bound(p.cfg, p.layout, Hardware(), worst_stage(p.cfg, p.layout, Hardware()))
        assert compute_bound(p.cfg, p.layout, Hardware()) <= bound <= p.time.total


def test_search_at_16384_devices_plans_few_layouts():
    """At 16,384 devices (Llama 3.2 1B, its config's 1F1B) the search enumerates 6,300 valid layouts, each of
    which the exhaustive search planned stage by stage and simulated, and plans a few dozen in full."""
    counts = {}
    plans = search(case_config("configs/llama-3.2-1b.yaml", []), 16384, Hardware(), None, top=TOP, counts=counts)
    assert len(plans) == TOP and all(p.fits for p in plans)
    assert counts["valid"] > 6000 and counts["planned"] < 200, counts
