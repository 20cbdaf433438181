"""The layout search and step-time model (engine/planning/search.py) and the planner's command line, launch/plan.py.
Step times are checked against figures computed by hand from the documented model; memory is checked against
measurement in tests/planning/test_planner.py."""

import dataclasses
import importlib.util
import json
import time

import pytest

from engine.config import load
from engine.planning.devices import KINDS
from engine.planning.planner import with_layout
from engine.planning.schedules import SEARCHED
from engine.planning.search import Hardware, layouts, search, step_time
from tests.cli import ROOT, one_error_line, run_script
from tests.planning.models import HW, tiny

# tiny: 25264128 FLOPs per token at seq 128 (tests/model/test_flops.py); 4999424 parameters in all.
FLOPS, PARAMS = 25264128, 4999424


def test_single_device_is_compute_only():
    st = step_time(tiny(), 1, HW)
    assert st.total == pytest.approx(16 * 128 * FLOPS / (100e12 * 0.5))
    assert st.tp_comm == st.pp_comm == st.dp_comm == st.bubble == 0
    assert st.mfu == pytest.approx(0.5)


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    st = step_time(tiny(pp=2, dp=1), 2, HW)  # m = 16 / 4 = 4 micro-batches
    assert st.bubble / st.total == pytest.approx(1 / (4 + 1))


def test_tensor_parallel_all_reduces():
    # per micro-batch: 4 layers x (2 row-parallel forward + 2 fused column-parallel backward) + embedding + LM head
    # = 18 all-reduces of one (4, 128, 256) fp32 activation (524288 bytes); a 2-rank ring moves 2 * 1/2 of it.
    st = step_time(tiny(tp=2, dp=1), 2, HW)
    assert st.tp_comm == pytest.approx(4 * 18 * 524288 / 100e9)


def test_ddp_gradient_all_reduce():
    st = step_time(tiny(dp=2), 2, HW)
    assert st.dp_comm == pytest.approx(4 * PARAMS / 100e9)  # fp32 gradients, 2 (n-1)/n = 1 at n = 2


def test_fsdp_reduce_scatter_overlaps_the_backward():
    """FSDP reduce-scatters each block's gradients as its backward ends: only the last block's and the root unit's
    (embedding, norm, head: 4 x (256 + 2 x 4096 x 256) parameters) stay exposed when the backward (2/3 of 4 x 128 x
    FLOPS at 50 TFLOP/s, 173 us) outlasts the whole reduce-scatter (4 PARAMS bytes, half of them per rank of 2 at
    100 GB/s: 100 us); the weights' all-gathers (the same 100 us) hide under a micro-batch's compute."""
    # one micro-batch a rank (8 / (4 x 2)): with more, each earlier micro-batch's reduce-scatter shares the link
    # with the next one's all-gathers (sharded accumulation), which this case leaves out
    st = step_time(tiny(dp=2, dp_mode="fsdp", global_batch_size=8), 2, HW)
    layer = (PARAMS - 256 - 2 * 4096 * 256) // 4
    assert st.dp_comm == pytest.approx(4 * (layer + 256 + 2 * 4096 * 256) / 2 / 100e9)


def test_layouts_are_the_valid_ones():
    # world 2, global batch 4, x 3 checkpointing modes (none, full, selective): (tp, pp, dp) = (1, 1, 2):
    # micro-batch 1 or 2, 6 dp modes, and at micro-batch 1 (2 micro-batches) fsdp's two with unsharded gradients:
    # 42; (1, 2, 1): 1f1b needs 4 / mbs >= 2 micro-batches, so mbs 1 or 2, ddp only at dp = 1: 6; (2, 1, 1): mbs 1,
    # 2, 4, sequence parallelism off and on: 18; cp 2 (dp 1, but the state shards over dp x cp = 2): mbs 1, 2, 4,
    # 6 dp modes, and 2 unsharded at mbs 1 and 2 (4 and 2 micro-batches), ring and all_to_all: 132. tp = 4 needs 4
    # ranks; no layout leaves pp_layers from another pp.
    found = list(layouts(tiny(global_batch_size=4), 2))
    assert len(found) == 198
    assert {c.parallel.sequence_parallel for c, layout in found if layout.tp == 2} == {False, True}
    p = [c.parallel for c, _ in found]
    modes = {(p.dp_mode, p.zero_stage, p.reshard_after_forward, p.fsdp_grad_accumulation) for p in p}
    assert len(modes) == 8
    # unsharded only where it differs: more than one micro-batch a step
    assert all(
        c.train.global_batch_size // layout.dp > c.train.micro_batch_size
        for c, layout in found
        if c.parallel.fsdp_grad_accumulation == "unsharded"
    )
    found8 = [layout for _, layout in layouts(tiny(), 8)]
    assert max(layout.tp for layout in found8) == 4  # tiny's 4 KV heads
    cfg = load(["--config", "configs/llama-3.2-1b.yaml"])
    for c, layout in layouts(with_layout(cfg, global_batch_size=64), 16):
        assert not (c.parallel.dp_mode == "zero" and c.parallel.zero_stage == 3 and layout.pp > 1)


def test_search_puts_fitting_layouts_first_fastest_first():
    cfg = load(["--config", "configs/llama-3.2-1b.yaml", "--train.global_batch_size", "64"])
    plans = search(cfg, 8, Hardware(memory_gb=24.0))
    fits = [p.fits for p in plans]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True)
    times = [p.time.total for p in plans if p.fits]
    assert times == sorted(times)
    assert all(p.peak_bytes <= 24e9 for p in plans if p.fits)


def _plan_module():
    spec = importlib.util.spec_from_file_location("plan_cli", ROOT / "launch" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_table_json_and_errors(capsys):
    cli = _plan_module()
    assert cli.main(["--config", "configs/tiny.yaml", "--world-size", "4", "--device-memory", "1", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["tp", "pp", "dp", "cp", "cp", "mode"] and len(lines) == 2 + 5
    assert cli.main(["--config", "configs/tiny.yaml", "--world-size", "4", "--device-memory", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # the config leaves the schedule open: every schedule is searched, on the hardware plan.py derives from its
    # arguments (the no-sync layouts listed depend on it: only those planned faster than sharded)
    hw = cli.hardware(
        cli.parse_args(["--config", "configs/tiny.yaml", "--world-size", "4", "--device-memory", "1"]), "fp32"
    )
    assert len(rows) == len(search(tiny(), 4, hw, SEARCHED)) and {"tp", "peak_memory_gb", "step_s"} <= set(rows[0])
    bad = {
        ("--world-size", "0"): "--world-size=0 must be > 0",
        ("--device", "cpu"): "no fp32 peak known for --device='cpu'",
        ("--set", "train.bogus=1"): "unknown config key 'train.bogus'",
        ("--device-memory", "0.001"): "no layout fits in --device-memory=0.001 GB",
    }
    for (flag, value), message in bad.items():
        argv = {"--config": "configs/tiny.yaml", "--world-size": "4", "--device-memory": "1", flag: value}
        with pytest.raises(ValueError, match=message):
            cli.main([x for kv in argv.items() for x in kv])


def test_cli_exits_2_with_one_line():
    result = run_script("launch/plan.py", "--config", "configs/tiny.yaml", "--world-size", "4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: the following arguments are required: --device-memory"]


@pytest.mark.parametrize(
    "flag,value,words",
    [
        (
            "--peak-tflops",
            "-5",
            "--peak-tflops=-5.0 must be > 0 and finite (TFLOP/s per device), or 0 for the --device",
        ),
        ("--peak-tflops", "nan", "--peak-tflops=nan must be > 0 and finite"),
        ("--device-memory", "nan", "--device-memory=nan must be > 0 and finite"),
        ("--hbm-gbps", "-1", "--hbm-gbps=-1.0 must be >= 0 and finite"),
    ],
)
def test_cli_refuses_a_negative_or_nan_figure_in_one_line(flag, value, words):
    """Issue 42: --peak-tflops -5 divided by zero in the schedule simulation (a traceback)."""
    argv = ["--config", "configs/tiny.yaml", "--world-size", "4", "--device-memory", "1", flag, value]
    one_error_line(run_script("launch/plan.py", *argv), words)


def test_long_search_shows_progress_on_stderr_only(capsys, monkeypatch):
    """A search that takes longer than PROGRESS_EVERY_S says so on stderr every PROGRESS_EVERY_S seconds (before:
    nothing for 30 s to 3 min), and how long it took; stdout is the same table as a search that says nothing."""
    cli = _plan_module()
    argv = ["--config", "configs/tiny.yaml", "--world-size", "4", "--device-memory", "1", "--top", "5"]
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 1e9)
    assert cli.main(argv) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""
    searched = cli.search

    def slow(*args):
        time.sleep(2.0)  # 20 progress intervals
        return searched(*args)

    monkeypatch.setattr(cli, "search", slow)
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.1)
    assert cli.main(argv) == 0
    got = capsys.readouterr()
    assert got.out == quiet.out
    lines = got.err.splitlines()
    assert len(lines) >= 2 and all(
        line.startswith("plan: searching the layouts of tiny on 4 devices: ") for line in lines
    ), lines
    assert lines[-1].startswith("plan: searching the layouts of tiny on 4 devices: done in ")


def test_cli_efficiency_is_the_device_kinds_or_measured(tmp_path):
    """Issue 46: the efficiency defaults to the --device kind's (engine/planning/devices.py; a CPU's is 1, its
    --peak-tflops being the rate step.py measures), and --efficiency-from takes what launch/bench/step.py measured
    (its --json-out, here on this CPU with a given peak); a file without one is refused in one line."""
    tiny = ["--config", "configs/tiny.yaml", "--world-size", "2", "--device-memory", "1", "--top", "1"]
    run = run_script("launch/plan.py", *tiny, "--device", "cpu", "--peak-tflops", "0.5")
    assert run.returncode == 0, run.stderr
    assert f"0.5 TFLOP/s at {KINDS['cpu'].efficiency:.0%};" in run.stdout.splitlines()[0]
    step = tmp_path / "step.json"
    bench = ["--config", "configs/tiny.yaml", "--set", "log.peak_tflops=0.5", "--set", "train.global_batch_size=4"]
    bench += ["--steps", "1", "--warmup", "0", "--side", "ours", "--out-dir", str(tmp_path / "out")]
    measured = run_script("launch/bench/step.py", *bench, "--json-out", str(step))
    assert measured.returncode == 0, measured.stderr
    efficiency = json.loads(step.read_text())["efficiency"]
    run = run_script("launch/plan.py", *tiny, "--device", "cpu", "--peak-tflops", "0.5", "--efficiency-from", step)
    assert run.returncode == 0, run.stderr
    assert f"0.5 TFLOP/s at {efficiency:.0%};" in run.stdout.splitlines()[0]
    step.write_text(json.dumps({"efficiency": None}))
    one_error_line(run_script("launch/plan.py", *tiny, "--efficiency-from", step), "has no efficiency", "--efficiency")


def test_fsdp_without_sync_is_listed_only_where_it_plans_faster():
    """The no-sync trade (whole fp32 gradients for one reduce-scatter a step) is searched, and a layout that takes
    it is listed only where it plans faster than the same layout with sharded gradients, which holds less: at
    equal time it would only crowd its twin in the table. Tiny's 1.4 M parameters on slow links at 8 ranks (its
    reduce-scatters outlast the micro-batches' compute) make it the faster choice somewhere."""
    slow = Hardware(peak_tflops=100.0, efficiency=0.5, intra_node_gbps=1.0)
    assert _only_where_faster(search(tiny(), 8, slow, SEARCHED), slow), "the no-sync trade never planned faster"
    # Llama 3.2 1B on 8 H100s: the micro-batches' compute hides every reduce-scatter; sharded and no-sync plan the
    # same time (the best 15 were eight no-sync rows beside their twins before the search left them out)
    cfg = load(["--config", "configs/llama-3.2-1b.yaml"])
    fast = Hardware(memory_gb=80.0)
    plans = search(cfg, 8, fast, top=15)
    assert not [p.describe() for p in plans if p.cfg.parallel.fsdp_grad_accumulation == "unsharded"]


def _only_where_faster(plans: list, hw: Hardware) -> list:
    """The plans that take the no-sync trade, checked: each is faster than its twin with sharded gradients."""
    nosync = [p for p in plans if p.cfg.parallel.fsdp_grad_accumulation == "unsharded"]
    for p in nosync:
        twin = dataclasses.replace(
            p.cfg, parallel=dataclasses.replace(p.cfg.parallel, fsdp_grad_accumulation="sharded")
        )
        assert p.time.total < step_time(twin, p.layout.world_size, hw, p.layout).total, p.describe()
        assert p.describe()["dp_mode"].endswith("-nosync") and p.describe()["micro_batches"] > 1

    def key(p) -> tuple:
        c, t = p.cfg.parallel, p.cfg.train
        return (
            p.layout,
            t.micro_batch_size,
            t.activation_checkpointing,
            c.schedule,
            c.virtual_stages,
            c.sequence_parallel,
            c.reshard_after_forward,
        )

    sharded = {key(p) for p in plans if p.cfg.parallel.dp_mode == "fsdp" and p not in nosync}
    assert all(key(p) in sharded for p in nosync)  # its twin is planned too, slower
    return nosync
