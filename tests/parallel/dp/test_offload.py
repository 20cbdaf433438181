"""Optimizer / parameter offload (issue 27): parallel.offload, the DeepSpeed file's offload keys, FSDP2's
CPUOffloadPolicy, the refusals, and the planner's host bytes.

On a CPU-only machine host and device are the same memory, so offload saves nothing here: the training tests show
that the offload path is really taken (DeepSpeed's engine reports its CPU offload, FSDP's parameters are marked
offload_to_cpu) and that it trains exactly like the same dp mode without offload (tests/parity/matrix.py
offload_slice compares the offload modes with one process). Bounds: fp32 losses and grad norms rel 1e-5, final
parameters 1e-3 of their update, parity's FP32 tolerance (tests/parity/runner.py).
"""

from __future__ import annotations

import json

import pytest

from engine.config import ConfigError, load
from engine.planning.dp import model_state_parts
from engine.planning.planner import stage_memory
from tests.cli import run_script
from tests.parity import runner

BASE = [*runner.BASE, "--train.grad_clip", str(runner.CLIP), "--parallel.dp", "2"]
ZERO = ["--parallel.dp_mode", "zero", "--parallel.zero_stage"]
ISSUE_FILE = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}  # issue 27's ds.json


def _file(tmp_path, content: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return str(path)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--parallel.offload", "optimizer"], "needs parallel.dp_mode zero (got ddp)"),  # the modes honouring it
        (["--parallel.offload", "optimizer_and_params"], "needs parallel.dp_mode fsdp or zero (got ddp)"),
        (["--parallel.offload", "cpu"], "parallel.offload='cpu' is not one of none, optimizer, optimizer_and_params"),
        (["--parallel.dp_mode", "fsdp", "--parallel.offload", "optimizer"], "use offload=optimizer_and_params"),
        ([*ZERO, "2", "--parallel.offload", "optimizer_and_params"], "needs parallel.zero_stage=3"),
    ],
)
def test_bad_offload_key_is_one_line(argv, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        load([*BASE, *argv])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "zero,extra,words",
    [
        ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, [], "offload_optimizer.nvme_path"),
        ({"offload_optimizer": {"device": "nvme"}}, [], "NVMe offload is not supported"),
        # offload_param checked also without offload_optimizer (issue 45: the loop stopped at the absent one)
        ({"offload_param": {"device": "nvme"}}, [], "'zero_optimization.offload_param.device'='nvme'"),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, [], "offload_optimizer.ratio"),
        ({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, [], "only in ZeRO-3"),
        ({"cpu_offload": True}, [], "deprecated by DeepSpeed"),
        ({"offload_optimizer": {"device": "none"}}, ["--parallel.offload", "optimizer"], "disagree"),
        ({"offload_optimizer": "cpu"}, [], "not an object of keys"),
    ],
)
def test_unhonourable_ds_config_offload_is_one_line(tmp_path, zero, extra, words):
    with pytest.raises(ConfigError, match=words) as e:
        load([*BASE, *ZERO, "2", "--parallel.ds_config", _file(tmp_path, {"zero_optimization": zero}), *extra])
    assert "\n" not in str(e.value)


def test_offload_optimizer_choice_is_the_engines(tmp_path):
    with pytest.raises(ConfigError, match="sets 'zero_force_ds_cpu_optimizer'; remove it"):
        load([*BASE, *ZERO, "2", "--parallel.ds_config", _file(tmp_path, {"zero_force_ds_cpu_optimizer": True})])


def test_refusal_reaches_the_command_line_as_one_line_exit_2(tmp_path):
    path = _file(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    out = run_script("launch/pretrain.py", *BASE, *ZERO, "2", "--parallel.ds_config", path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "NVMe offload is not supported" in lines[0], out.stderr[-2000:]


def test_ds_config_offloads_from_the_key_or_the_file(tmp_path):
    from engine.parallel.dp.zero import ds_config

    class Ctx:
        dp = 2

    by_key = ds_config(load([*BASE, *ZERO, "3", "--parallel.offload", "optimizer_and_params"]), Ctx())
    z = by_key["zero_optimization"]
    assert z["offload_optimizer"] == z["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert by_key["zero_force_ds_cpu_optimizer"] is False
    by_file = ds_config(load([*BASE, *ZERO, "2", "--parallel.ds_config", _file(tmp_path, ISSUE_FILE)]), Ctx())
    assert by_file["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_optimizer" not in ds_config(load([*BASE, *ZERO, "2"]), Ctx())["zero_optimization"]


# ---- training ----------------------------------------------------------------------------------------------------


def train(argv: list[str]) -> dict:
    """Rank function: train; losses, grad norms, final fp32 parameters, and whether offload was on."""
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    history = trainer.fit()
    dp = trainer.dp
    if cfg.parallel.dp_mode == "zero":
        on = (
            bool(dp.engine.zero_cpu_offload()),
            dp.engine.zero_offload_param() is not None,
            type(dp.engine.basic_optimizer).__name__,
        )
    else:  # FSDP2 marks every parameter it offloads
        state = dp.module._get_fsdp_state()._fsdp_param_group
        on = (all(p.offload_to_cpu for p in state.fsdp_params),)
    return {
        "loss": [r["loss"] for r in history],
        "grad_norm": [r["grad_norm"] for r in history],
        "params": {n: v for n, (v, *_) in runner.held_parameters(trainer).items()},
        "on": on,
    }


def _compare(got: dict, want: dict, init: dict | None = None) -> None:
    tol = runner.FP32
    for key, bound in (("loss", tol.loss), ("grad_norm", tol.grad_norm)):
        worst = max(abs(g - w) / abs(w) for g, w in zip(got[key], want[key]))
        assert worst <= bound, f"{key}: rel {worst:.1e} > {bound}: {got[key]} vs {want[key]}"
    assert set(got["params"]) == set(want["params"])
    for name, w in want["params"].items():
        err = (got["params"][name] - w).norm() / (w - init[name]).norm()
        assert err <= tol.params, f"{name}: {err:.1e} of its update"


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """The initial parameters (the same at every layout: engine/model/init.py), to measure updates against."""
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer
    from tests.dist import run_ranks

    def rank(argv):
        cfg = load(argv)
        return {n: v for n, (v, *_) in runner.held_parameters(Trainer(cfg, ParallelContext.from_config(cfg))).items()}

    return run_ranks(rank, 1, [*runner.BASE, "--parallel.dp", "1", *_out(tmp_path_factory.mktemp("init"))])[0]


def _out(folder) -> list[str]:
    return ["--train.out_dir", str(folder)]  # not the default runs/tiny of the working directory (the checkout)


def _pair(tmp_path, offloaded: list[str], plain: list[str]) -> tuple[list, list]:
    from tests.dist import run_ranks

    return (
        run_ranks(train, 2, [*BASE, *offloaded, *_out(tmp_path / "offloaded")], timeout_s=600),
        run_ranks(train, 2, [*BASE, *plain, *_out(tmp_path / "plain")], timeout_s=600),
    )


def test_issue_ds_config_zero2_offload_trains_like_zero2(tmp_path, init):
    pytest.importorskip("deepspeed")
    got, want = _pair(tmp_path, [*ZERO, "2", "--parallel.ds_config", _file(tmp_path, ISSUE_FILE)], [*ZERO, "2"])
    assert got[0]["on"][:2] == (True, False) and want[0]["on"][:2] == (False, False)
    _compare(got[0], want[0], init)


def test_zero3_optimizer_and_params_trains_like_zero3(init, tmp_path):
    pytest.importorskip("deepspeed")
    got, want = _pair(tmp_path, [*ZERO, "3", "--parallel.offload", "optimizer_and_params"], [*ZERO, "3"])
    assert got[0]["on"][:2] == (True, True)
    _compare(got[0], want[0], init)


def test_fsdp_cpu_offload_trains_like_fsdp(init, tmp_path):
    fsdp = ["--parallel.dp_mode", "fsdp"]
    got, want = _pair(tmp_path, [*fsdp, "--parallel.offload", "optimizer_and_params"], fsdp)
    assert got[0]["on"] == (True,) and want[0]["on"] == (False,)
    _compare(got[0], want[0], init)


# ---- planner ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    [
        [*ZERO, "2", "--parallel.offload", "optimizer"],
        [*ZERO, "3", "--parallel.offload", "optimizer_and_params"],
        ["--parallel.dp_mode", "fsdp", "--parallel.offload", "optimizer_and_params", "--train.global_batch_size", "2"],
    ],
)
def test_planner_moves_state_to_host_and_keeps_the_total(mode):
    """What offload takes off the device is what the host gets: the model state (plus AdamW's temporaries for
    fsdp) before equals device state + host after, at one micro-batch (several keep fsdp's unsharded gradients
    on the device, besides the host copy, under parallel.fsdp_grad_accumulation=unsharded)."""
    argv = [*BASE, *mode]
    off = stage_memory(load(argv), 2, 0)
    plain = stage_memory(load([*argv, "--parallel.offload", "none"]), 2, 0)
    assert off.host > 0 and plain.host == 0
    assert off.optimizer == 0 and off.state < plain.state and off.total < plain.total
    before, after = plain.state + plain.step_buffers, off.state + off.step_buffers + off.host
    assert abs(after - before) <= 1e-9 * before, (after, before)


def test_planner_zero2_offload_host_bytes_follow_zero_offload():
    """ZeRO-Offload (Ren et al. 2021): the host holds the fp32 master + Adam moments (12 bytes) and the fp32
    gradient partition (4 bytes) of the rank's 1/dp share; the device keeps the 4-byte fp32 weights."""
    cfg = load([*BASE, *ZERO, "2", "--parallel.offload", "optimizer"])
    plain = stage_memory(load([*BASE, *ZERO, "2"]), 2, 0)
    local = plain.weights / 4  # fp32 ZeRO weights: 4 bytes per local parameter
    off = stage_memory(cfg, 2, 0)
    _, _, k = model_state_parts(local, 2, 2, "fp32_master")
    assert off.host == pytest.approx(k + 4 * local / 2) and off.weights == plain.weights and off.grads == 0


def test_search_tries_offload_only_where_nothing_fits_without_it():
    """launch/plan.py's search: no offload layout while one without offload fits; below the smallest of those, the
    offload layouts are planned, and those that fit keep bytes on the host."""
    from engine.planning.search import Hardware, search

    cfg = load(["--config", "configs/tiny.yaml"])
    plain = search(cfg, 2, Hardware())
    assert any(c.fits for c in plain) and all(c.cfg.parallel.offload == "none" for c in plain)
    tight = search(cfg, 2, Hardware(memory_gb=0.99 * min(c.peak_bytes for c in plain) / 1e9))
    fitting = [c for c in tight if c.fits]
    assert fitting and all(c.cfg.parallel.offload != "none" and c.describe()["host_gb"] > 0 for c in fitting)
