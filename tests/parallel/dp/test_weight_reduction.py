"""Zero bubble's dp reduction (issue 27): DDP averages each chunk's gradient buckets during the chunk's last W, as
each bucket completes (engine/parallel/dp/buckets.py ReadyBuckets), instead of one exposed all-reduce after the
last W; the buckets launch in the same order on every dp rank (NCCL's rule). Recorded, not timed: the trainer
runs pp 2 x dp 2 with tiny buckets (about one parameter each), W's and all-reduces are logged in the order they
are issued. That the reduced gradients are right is the parity matrix's job (tests/parity, zero_bubble slices)."""

from __future__ import annotations

import types

import pytest

from tests.dist import run_ranks
from tests.parity.runner import BASE

ZB = [
    *BASE,
    "--parallel.pp",
    "2",
    "--parallel.dp",
    "2",
    "--parallel.schedule",
    "zero_bubble",
    "--parallel.dp_mode",
    "ddp",
    "--parallel.bucket_mb",
    "0.01",
    "--train.steps",
    "2",
]


def order_rank(argv: list[str], overlap: bool) -> dict:
    """Rank function: one step; the issue order of W's (start, end) and dp all-reduces (their sizes)."""
    import torch.distributed as dist

    from engine.config import load
    from engine.parallel.dp import buckets
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    cfg = load(argv)
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    trainer.dp.overlap_weight_reduction = overlap
    events: list[tuple] = []
    store = trainer.executor.weight_grads
    flush = store.flush

    def recorded_flush(key, done=None):
        events.append(("W", key, "start"))
        flush(key, done)
        events.append(("W", key, "end"))

    store.flush = recorded_flush
    last_weight = trainer.dp.last_weight

    def recorded_last_weight(store, key, chunk=0):  # the executor's call for a chunk's last W
        events.append(("last W", key, "start"))
        last_weight(store, key, chunk)

    trainer.dp.last_weight = recorded_last_weight

    def recorded_all_reduce(t, group=None, async_op=False):
        events.append(("all_reduce", t.numel()))
        return dist.all_reduce(t, group=group, async_op=async_op)

    buckets.dist = types.SimpleNamespace(all_reduce=recorded_all_reduce, get_world_size=dist.get_world_size)
    trainer.observers.append(lambda event: events.append(("update",)) if event == "update" else None)
    trainer.fit()
    # The first step: its W's, the all-reduces issued during them, and those issued in reduce_gradients after
    # the "update" observer (before the next step's first W).
    step, after = events[: events.index(("update",))], []
    for e in events[events.index(("update",)) + 1 :]:
        if e[0] == "W":
            break
        after.append(e)
    return {
        "pp_rank": ctx.pp_rank,
        "events": step + after,
        "micro_batches": trainer.micro_batches,
        "embedding": cfg.model.vocab_size * cfg.model.hidden_size,
        "params": sum(p.numel() for p in trainer.dp.module.parameters() if p.requires_grad),
    }


@pytest.fixture(scope="module")
def orders(tmp_path_factory):
    return {
        overlap: run_ranks(
            order_rank, 4, [*ZB, "--train.out_dir", str(tmp_path_factory.mktemp(str(overlap)))], overlap, timeout_s=300
        )
        for overlap in (True, False)
    }


def _positions(run: dict) -> tuple[int, int, int, list[int]]:
    """(index of the executor's call for the last W, of its flush's start, of its end, indices of the
    all-reduces) in one rank's events."""
    events = run["events"]
    last = (run["micro_batches"] - 1, 0)
    call = events.index(("last W", last, "start"))
    start, end = events.index(("W", last, "start")), events.index(("W", last, "end"))
    return call, start, end, [i for i, e in enumerate(events) if e[0] == "all_reduce"]


def test_buckets_reduced_during_the_last_w(orders):
    """Overlapped: no bucket before the chunk's last W is called (its gradients are not complete; the buckets
    of gradients B finished, norms and the LM head, may go before W's flush starts), buckets of W's gradients
    while its flush still runs, several buckets in all."""
    for run in orders[True]:
        call, start, end, reduces = _positions(run)
        assert len(reduces) >= 3, "the test needs several buckets: lower bucket_mb"
        assert min(reduces) > call, run["events"]
        assert any(start < i < end for i in reduces), "no bucket was launched during the last W's flush"


def test_exposed_path_reduces_after_the_last_w(orders):
    """overlap_weight_reduction = False (the older path, kept for the benchmark): every all-reduce after the
    last W ends."""
    for run in orders[False]:
        _, _, end, reduces = _positions(run)
        assert reduces and min(reduces) > end, run["events"]


@pytest.mark.parametrize("overlap", [True, False])
def test_same_collectives_in_the_same_order_on_dp_peers(orders, overlap):
    """The two dp ranks of each stage issue the same all-reduces (sizes) in the same order."""
    by_stage: dict[int, list] = {}
    for run in orders[overlap]:
        by_stage.setdefault(run["pp_rank"], []).append([e for e in run["events"] if e[0] == "all_reduce"])
    for stage, (a, b) in by_stage.items():
        assert a == b, f"stage {stage}: {a} != {b}"


def test_bench_prints_both_variants_side_by_side(capsys):
    """launch/bench/zb_dp.py (section d of launch/bench/schedules.py) on a tiny model: a row per stage and
    variant, and the two variants' losses equal (they average the same gradients); no timing is asserted."""
    from launch.bench import zb_dp

    args = zb_dp.parse_args(
        ["--steps", "1", "--layers", "2", "--hidden", "32", "--seq-len", "16", "--micro-batches", "2"]
    )
    with capsys.disabled():  # the forked ranks need the real stderr
        ranks = zb_dp.measure(args)
    zb_dp.print_table(ranks, args)
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.split()[:1] in (["0"], ["1"])]
    assert [(r[0], r[1]) for r in rows] == [(s, v) for s in "01" for v in zb_dp.VARIANTS]
    assert out[-1] == "largest loss difference between the variants: 0.00e+00"


def test_bench_bad_arguments_are_one_line_exit_2(capsys):
    from launch.bench import zb_dp

    with pytest.raises(SystemExit) as e:
        zb_dp.parse_args(["--dp", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--dp >= 2" in err and "dp 1" in err


def test_zbv_reduces_a_weight_both_chunks_hold_once_after_both_last_ws(tmp_path):
    """zbv with a tied embedding: rank 0's chunk 0 (embedding) and chunk 1 (LM head) hold one parameter, whose
    gradient is complete only after both chunks' backwards. Chunk 1's last W comes before chunk 0's last B there, so
    it must be in neither chunk's buckets: reduced once (the elements all-reduced are the stage's parameters), after
    both chunks' last W's ended; the chunks' other buckets still launch during their last W."""
    argv = [("zbv" if a == "zero_bubble" else a) for a in ZB]
    argv += ["--model.tie_embeddings", "true", "--train.out_dir", str(tmp_path)]
    for run in run_ranks(order_rank, 4, argv, True, timeout_s=300):
        events, last = run["events"], run["micro_batches"] - 1
        ends = [events.index(("W", (last, chunk), "end")) for chunk in (0, 1)]
        reduces = [i for i, e in enumerate(events) if e[0] == "all_reduce"]
        calls = [events.index(("last W", (last, chunk), "start")) for chunk in (0, 1)]
        assert any(call < i < end for i in reduces for call, end in zip(calls, ends)), events
        # once: the all-reduced elements are the stage's parameters, each counted once (a shared one too)
        assert sum(events[i][1] for i in reduces) == run["params"], events
        if run["pp_rank"] == 0:  # the shared embedding among the reductions after both chunks' last W's
            assert sum(events[i][1] for i in reduces if i > max(ends)) >= run["embedding"], events
