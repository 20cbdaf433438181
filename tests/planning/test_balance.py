"""parallel.pp_layers: auto (engine/planning/balance.py): the split minimising the slowest stage, the config value,
the planner's use of it, and a pp 2 run with the balanced split against one process."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.config import ConfigError, load
from engine.parallel.layout.checks import resolve_layout
from engine.parallel.pp.split import even_layers
from engine.planning.balance import (
    balanced_layers,
    best_split,
    chunk_cost,
    describe,
    layer_counts,
    rank_ranges,
    stage_cost,
)
from engine.planning.search import Hardware, step_time

TINY = ["--config", "configs/tiny.yaml"]


def _cfg(*argv: str):
    return load([*TINY, *argv])


def _slowest(cfg, counts: list[int]) -> int:
    return max(stage_cost(cfg, len(counts), s, k) for s, k in enumerate(counts))


def _compositions(n: int, parts: int):
    """Every split of n layers into ``parts`` stages of at least one."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_tiny_pp2_gives_the_last_stage_fewer_layers():
    """tiny's LM head (V = 4096, h = 256) costs more than a layer, so the last stage carries fewer layers, and its
    slowest stage is cheaper than the even split's (which the head makes the last stage)."""
    cfg = _cfg("--parallel.pp", "2", "--parallel.pp_layers", "auto")
    counts = layer_counts(cfg, 2)
    even = even_layers(cfg.model.num_layers, 2)
    assert sum(counts) == cfg.model.num_layers and counts[-1] < counts[0], counts
    assert _slowest(cfg, counts) < _slowest(cfg, even)
    head = stage_cost(cfg, 2, 1, 1) - stage_cost(cfg, 2, 0, 1)  # the last stage's extra: the head
    assert head > stage_cost(cfg, 2, 0, 1)  # why it moves a whole layer


@pytest.mark.parametrize("layers,pp", [(4, 2), (5, 2), (7, 3), (8, 4), (6, 4)])
def test_negligible_head_gives_the_even_split(layers, pp):
    cfg = _cfg("--model.vocab_size", "8", "--model.num_layers", str(layers), "--parallel.pp", str(pp))
    assert balanced_layers(cfg, pp) == even_layers(layers, pp)


@pytest.mark.parametrize("layers,pp", [(4, 2), (8, 2), (8, 4), (7, 3)])
@pytest.mark.parametrize("vocab", [4096, 32000])
def test_auto_split_is_the_best_of_every_split(layers, pp, vocab):
    """Against brute force over every composition: the least slowest stage, and no split with that maximum is more
    even (smaller sum of squared stage costs)."""
    cfg = _cfg("--model.vocab_size", str(vocab), "--model.num_layers", str(layers))
    counts = balanced_layers(cfg, pp)
    best = min(_slowest(cfg, c) for c in _compositions(layers, pp))
    assert _slowest(cfg, counts) == best

    def squares(c):
        return sum(stage_cost(cfg, pp, s, k) ** 2 for s, k in enumerate(c))

    assert squares(counts) == min(squares(c) for c in _compositions(layers, pp) if _slowest(cfg, c) == best)


def test_best_split_on_random_costs():
    """Any per-stage cost (a first or last stage with extra work, layers of different prices): brute-force optimum."""
    rng = random.Random(0)
    for _ in range(200):
        layers, pp = rng.randint(1, 9), rng.randint(1, 4)
        if pp > layers:
            continue
        per = [rng.randint(1, 20) for _ in range(pp)]
        extra = [rng.randint(0, 50) for _ in range(pp)]

        def cost(s, k):
            return per[s] * k + extra[s]

        counts = best_split(layers, pp, cost)
        assert len(counts) == pp and sum(counts) == layers and min(counts) >= 1
        worst = max(cost(s, k) for s, k in enumerate(counts))
        assert worst == min(max(cost(s, k) for s, k in enumerate(c)) for c in _compositions(layers, pp))


def test_planner_agrees_auto_is_faster_at_pp2():
    """The planner's step time (slowest stage's FLOPs through the simulated 1F1B) is shorter with auto."""
    even = _cfg("--parallel.pp", "2")
    auto = _cfg("--parallel.pp", "2", "--parallel.pp_layers", "auto")
    assert step_time(auto, 2, Hardware()).total < step_time(even, 2, Hardware()).total


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("[1,3]", [1, 3]), ("1,3", [1, 3]), ("[]", [])])
def test_config_accepts_auto_and_lists(value, want):
    cfg = _cfg("--parallel.pp", "2", "--parallel.pp_layers", value)
    assert cfg.parallel.pp_layers == want
    resolve_layout(cfg, 2)


@pytest.mark.parametrize(
    "value,needle",
    [
        ("junk", "parallel.pp_layers='junk' is not valid; use auto"),
        ("Auto", "parallel.pp_layers='Auto' is not valid; use auto"),
        ("3", "parallel.pp_layers=3 is neither a list [a,b] nor a word such as auto"),
        ("[1,x]", "parallel.pp_layers[1]='x' is not an integer"),
    ],
)
def test_config_refuses_junk(value, needle):
    with pytest.raises(ConfigError) as e:
        _cfg("--parallel.pp", "2", "--parallel.pp_layers", value)
    assert needle in str(e.value) and "\n" not in str(e.value)


CHUNKED = [("interleaved", ["--parallel.virtual_stages", "2"]), ("zbv", [])]


def _chunked(schedule: str, extra: list[str], *argv: str):
    return _cfg("--model.num_layers", "6", "--parallel.pp", "2", "--parallel.schedule", schedule, *extra, *argv)


@pytest.mark.parametrize("schedule,extra", CHUNKED)
def test_chunked_auto_gives_the_first_and_last_virtual_stage_fewer_layers(schedule, extra):
    """Interleaved and zbv: auto counts per virtual stage (pp*2 of them, virtual-stage order), the embedding's
    charged a layer and the LM head its FLOPs (Meta's and TorchTitan's shape), the best of every split under that
    cost; on 6 layers [1, 2, 2, 1], where the even split cannot cut 4 equal chunks (refused without pp_layers)."""
    cfg = _chunked(schedule, extra, "--parallel.pp_layers", "auto")
    resolve_layout(cfg, 2)
    counts = layer_counts(cfg, 2)
    assert counts == [1, 2, 2, 1]

    def slowest(c):
        return max(chunk_cost(cfg, 4, g, k) for g, k in enumerate(c))

    assert slowest(counts) == min(slowest(c) for c in _compositions(6, 4))
    assert "layers per virtual stage [1, 2, 2, 1]" in describe(cfg, 2)
    with pytest.raises(ConfigError, match="into 2\\*pp=4 equal chunks|into pp\\*virtual_stages=4 equal chunks"):
        resolve_layout(_chunked(schedule, extra), 2)


# Llama 3.1 405B under interleaved with 2 virtual stages, the balanced split (plan.py takes the first 6 alone: its
# search plans every pp, the balanced split where equal chunks cannot be cut)
LLAMA_405B_IL2 = [
    "--config",
    "configs/llama-3.1-405b.yaml",
    "--parallel.schedule",
    "interleaved",
    "--parallel.virtual_stages",
    "2",
    "--parallel.pp_layers",
    "auto",
    "--parallel.pp",
    "16",
]


def test_llama3_405b_auto_is_metas_layout():
    """126 layers on pp 16 x v 2 (32 virtual stages): one layer fewer on the first and the last, 4 elsewhere
    (Llama 3 paper, Sec. 3.3.2); rank 0 holds virtual stages 0 and 16, 7 layers, rank 15 stages 15 and 31."""
    cfg = load(LLAMA_405B_IL2)
    assert layer_counts(cfg, 16) == [3] + [4] * 30 + [3]
    assert rank_ranges(cfg, 16, 0) == [range(0, 3), range(63, 67)]
    assert rank_ranges(cfg, 16, 15) == [range(59, 63), range(123, 126)]


def test_llama3_405b_interleaved_is_planned(tmp_path):
    """launch/plan.py with the 405B config under interleaved (v 2) on 16 devices: every pp of the search (2..16)
    cuts 126 layers into 2 pp unequal chunks, which were refused before (exit 2, "equal chunks"); now planned, the
    balanced split searched. The planner at Meta's layout (tp 8, pp 16: Llama 3 paper, Table 4) gives rank 0 and
    rank 15 seven layers each, the others eight."""
    from engine.planning.planner import stage_params
    from tests.cli import run_script

    got = run_script(
        "launch/plan.py", *LLAMA_405B_IL2[:6], "--world-size", "16", "--device-memory", "2000", "--top", "3"
    )
    assert got.returncode == 0, got.stderr
    rows = got.stdout.splitlines()[2:]
    assert len(rows) == 3 and all(" il-v2 " in row for row in rows), got.stdout
    cfg = load([*LLAMA_405B_IL2, "--parallel.tp", "8", "--train.global_batch_size", "16"])
    assert resolve_layout(cfg, 128).pp == 16
    assert [stage_params(cfg, 8, 16, s)["num_layers"] for s in range(16)] == [7] + [8] * 14 + [7]


@pytest.mark.parametrize("schedule,extra", CHUNKED)
@pytest.mark.parametrize(
    "value,needle",
    [
        ("[3,3]", "parallel.pp_layers=[3, 3] must list 4 positive layer counts (one per virtual stage, pp*2, in "),
        ("[1,1,1,1]", "parallel.pp_layers=[1, 1, 1, 1] must list 4 positive layer counts"),
        ("[0,2,2,2]", "parallel.pp_layers=[0, 2, 2, 2] must list 4 positive layer counts"),
    ],
)
def test_chunked_counts_are_checked(schedule, extra, value, needle):
    """A list per virtual stage: the wrong length, a wrong sum or a zero is refused in one line naming the value
    and what is valid (its length, positive, the layer total)."""
    with pytest.raises(ConfigError) as e:
        resolve_layout(_chunked(schedule, extra, "--parallel.pp_layers", value), 2)
    assert needle in str(e.value) and "summing to model.num_layers=6" in str(e.value) and "\n" not in str(e.value)


def test_pp2_auto_trains_like_one_process(tmp_path):
    """The parity runner's model (its head is ~7 layers' FLOPs, so auto gives [3, 1]): 4 steps at pp 2 with the
    balanced split against one process, loss, grad norm and every final parameter within the fp32 bounds."""
    from tests.parity import matrix, runner  # the parity runner: the same model, data and bounds

    pytest.importorskip("deepspeed")  # tests.parity.runner imports the trainer's dp modes
    ref = matrix.Combo(1, 1, 1, "ddp", "-", "fp32", False, False, False)
    combo = matrix.Combo(1, 2, 1, "ddp", "1f1b", "fp32", False, False, False)
    argv = runner.combo_argv(combo, str(tmp_path / "auto"), "--parallel.pp_layers", "auto")
    counts = layer_counts(load(argv), 2)
    assert counts != even_layers(4, 2)  # the run exercises an uneven split
    want = runner.run_group(1, [runner.combo_argv(ref, str(tmp_path / "ref"))], want_init=True)[0][0]
    got = runner.run_group(2, [argv])[0]
    held = [{int(n.split(".")[2]) for n in r["params"] if ".layers." in n} for r in got]
    assert [len(h) for h in held] == counts
    runner.assert_matches(got, want)


def test_the_logged_line_names_both_splits():
    """What rank 0 prints (engine/trainer.py): the chosen split with its stage costs, and the even split's."""
    cfg = _cfg("--parallel.pp", "2", "--parallel.pp_layers", "auto")
    line = describe(cfg, 2)
    assert f"layers per stage {layer_counts(cfg, 2)}" in line and f"the even split {even_layers(4, 2)}" in line
    assert "\n" not in line
