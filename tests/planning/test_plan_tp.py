"""Tensor parallelism in the planner (engine/planning/tp.py): the overlapped collectives (parallel.tp_comm_overlap)
hidden behind matmuls that outlast their transfers and exposed behind those that do not, and the layout search
carrying the overlap wherever it applies. The rings it prices against the ones the model runs:
tests/parallel/tp/test_collective_matmul.py."""

from engine.config import load
from engine.planning import tp as tp_plan
from engine.planning.layouts import layouts
from engine.planning.search import Hardware

LLAMA_8B = ["--config", "configs/llama-3.1-8b.yaml", "--train.seq_len", "8192", "--parallel.backend", "nccl"]
SP = ["--parallel.tp", "8", "--parallel.sequence_parallel", "true"]


def _middle_stage(argv: list[str], hw: Hardware) -> float:
    """Planned exposed tp seconds of one micro-batch on a stage of 4 layers, neither embedding nor LM head."""
    cfg = load(argv)
    return sum(tp_plan.comm_time(cfg, 8, hw, cfg.train.seq_len, 4, 0, (False, False)))


def test_large_matmuls_hide_the_rings_small_ones_do_not():
    hw = Hardware()  # H100: NVLink 4 inside a node
    blocking = _middle_stage(LLAMA_8B + SP, hw)
    assert blocking > 0
    # Llama 3.1 8B at tp 8, 8K tokens in bf16: a ring step moves a (1, 1024, 4096) chunk, 28.6 us on NVLink with
    # its latency; a chunk's matmul at 0.5 of 989 TFLOP/s takes 13.0 (q/k/v), 8.7 (o), 60.8 (gate/up), 30.4 us
    # (down): the MLP's rings hide, the attention's show their excess
    overlapped = _middle_stage(LLAMA_8B + SP + ["--parallel.tp_comm_overlap", "true"], hw)
    assert 0 < overlapped < blocking / 2, (overlapped, blocking)
    # on a link 100x faster every ring hides: nothing exposed
    fast = Hardware(intra_node_gbps=45000.0, latency_us=0.0)
    assert _middle_stage(LLAMA_8B + SP + ["--parallel.tp_comm_overlap", "true"], fast) == 0.0
    assert _middle_stage(LLAMA_8B + SP, fast) > 0


def test_search_overlaps_where_it_applies():
    """With tp_comm_overlap asked, the layouts with sequence parallelism carry it, those without it (and zero
    bubble's, which the engine refuses it) do not, and none is refused for it."""
    argv = ["--config", "configs/tiny.yaml", "--parallel.tp_comm_overlap", "true", "--parallel.pp", "2"]
    cfg = load(argv + ["--train.global_batch_size", "8"])
    refused: list = []
    schedules = (("1f1b", 1), ("zero_bubble", 1))
    seen = {
        (c.parallel.schedule, c.parallel.sequence_parallel, c.parallel.tp_comm_overlap)
        for c, _ in layouts(cfg, 8, schedules, refused)
        if c.parallel.tp > 1 and c.parallel.pp > 1
    }
    assert seen == {
        ("1f1b", False, False),
        ("1f1b", True, True),
        ("zero_bubble", False, False),
        ("zero_bubble", True, False),
    }, seen
    assert not [r for r in refused if "tp_comm_overlap" in r[1]], refused
