"""Balanced pipeline stages (``parallel.pp_layers: auto``): the split of the decoder layers over pp stages that
minimises the slowest stage's compute.

A stage's cost is its FLOPs per training token, engine/model/flops.py ``stage_flops_per_token`` (PaLM's
6 N + 12 L H Q T, recomputation included, as the planner's step time counts it): its decoder layers and, on the
last stage, the LM head, a (h x V) matmul of 2 h V FLOPs per token forward, 6 h V with the backward. The first
stage's embedding is a lookup and the final norm and the cross-entropy are element-wise (O(h) and O(V) per token
against the head's O(h V)), so none of them counts. Every stage runs every micro-batch, so in 1F1B's steady state
each micro-batch costs the slowest stage's F + B (Narayanan et al. 2021, Sec. 2.2); on the tiny shapes the head
is worth about 1.3 layers, and the even split's last stage does ~1.7x the first stage's work at pp 2.

Choosing contiguous layer counts that minimise the largest stage cost is the linear partition problem (Skiena,
"The Algorithm Design Manual", Sec. 8.5; PipeDream's planner solves the same by dynamic programming, Narayanan et
al. 2019, Sec. 3.1). ``best_split`` solves it exactly over suffixes of stages:

    worst(s, n) = min over k in 1..n-(pp-s-1) of max(cost(s, k), worst(s+1, n-k))     worst(pp, 0) = 0

(stages s..pp-1 holding the last n layers, each at least one). Among the splits reaching worst(0, L) it takes the
one with the smallest sum of squared stage costs (the most even), then the one whose earlier stages hold more
layers (the even split's rule for a remainder), so a negligible head gives the even split.

The default stays the even split: auto balances compute, not memory, and the layers it moves go to the earlier
stages, which under 1F1B already hold the most micro-batches in flight (pp - stage), so auto can raise the peak
memory of stage 0 where the even split fits (launch/plan.py prints both, per stage).

Chunked schedules (interleaved: v virtual stages per rank; zbv: 2 in a V; ScheduleSpec.per_rank) split the layers
into pp*v contiguous runs, one per virtual stage, so their counts are pp*v long, in virtual-stage order. Their auto
solves the same problem over the virtual stages, with the embedding's virtual stage also charged one decoder layer:
the split Llama 3 405B trained with (Llama 3 paper, Sec. 3.3.2: one layer fewer on the first stage, which holds the
embedding and the most warm-up micro-batches, and on the last, which computes the output and the loss) and
TorchTitan's default (pipeline_parallel_first_stage_less_layers = pipeline_parallel_last_stage_less_layers = 1).
The LM head keeps its FLOPs (0.65 of a layer at 405B), so 126 layers on pp 16 x v 2 give [3, 4 x 30, 3]. Every cost
is a multiple of one layer's plus the head's and the embedding's, so a split is computed once per (layers, stages,
costs) and cached: the planner asks for it at every layout it plans.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from engine.config import Config
from engine.kinds.schedules import SCHEDULES
from engine.model.flops import stage_flops_per_token
from engine.parallel.pp import schedule as sched
from engine.parallel.pp.split import chunk_layer_ranges, even_layers, stage_layer_ranges

EMBEDDING_LAYERS = 1  # chunked schedules' auto: the embedding's virtual stage charged as this many decoder layers


def stage_cost(cfg: Config, pp: int, stage: int, layers: int) -> int:
    """FLOPs per token of pipeline ``stage`` holding ``layers`` decoder layers (the LM head on the last stage)."""
    return stage_flops_per_token(
        cfg.model, cfg.train.seq_len, layers, stage == pp - 1, cfg.train.activation_checkpointing
    )


def chunk_cost(cfg: Config, chunks: int, g: int, layers: int) -> int:
    """Cost of virtual stage ``g`` of ``chunks`` holding ``layers`` layers, for a chunked schedule's auto: its
    layers' FLOPs per token, the LM head's on the last, and the embedding's charged as EMBEDDING_LAYERS layers on
    the first (module docstring)."""
    first = EMBEDDING_LAYERS if g == 0 else 0
    return stage_cost(cfg, chunks, g, layers + first)


def best_split(num_layers: int, pp: int, cost: Callable[[int, int], int]) -> list[int]:
    """Layer counts (one per stage, each >= 1, summing to ``num_layers``) minimising max_s cost(s, counts[s]);
    ties as the module docstring says. ``cost(stage, layers)``: an integer cost (exact comparisons)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} stages of at least one layer")
    inf = float("inf")
    table = [[cost(s, k) for k in range(num_layers + 1)] for s in range(pp)]  # table[s][k]: stage s with k layers

    def choices(s: int, n: int) -> range:  # layers stage s may take when stages s.. hold n (>= 1 for each later one)
        return range(1, n - (pp - s - 1) + 1)

    worst = [[inf] * (num_layers + 1) for _ in range(pp + 1)]  # worst[s][n] as in the docstring
    worst[pp][0] = 0
    for s in reversed(range(pp)):
        for n in range(pp - s, num_layers + 1):
            worst[s][n] = min(max(table[s][k], worst[s + 1][n - k]) for k in choices(s, n))
    cap = worst[0][num_layers]
    squares = [[inf] * (num_layers + 1) for _ in range(pp + 1)]  # least sum of squares with every stage <= cap
    squares[pp][0] = 0
    for s in reversed(range(pp)):
        for n in range(pp - s, num_layers + 1):
            squares[s][n] = min(
                (table[s][k] ** 2 + squares[s + 1][n - k] for k in choices(s, n) if table[s][k] <= cap), default=inf
            )
    counts, n = [], num_layers
    for s in range(pp):  # forward, the most layers first: earlier stages take more among equals
        k = max(
            k for k in choices(s, n) if table[s][k] <= cap and table[s][k] ** 2 + squares[s + 1][n - k] == squares[s][n]
        )
        counts.append(k)
        n -= k
    return counts


def balanced_layers(cfg: Config, pp: int) -> list[int]:
    """The split minimising the slowest stage's cost (parallel.pp_layers: auto): per stage its FLOPs per token,
    per virtual stage under a chunked schedule (``chunk_cost``)."""
    chunks = sched.layer_runs(cfg.parallel, pp)
    layer, head = stage_cost(cfg, 1, 1, 1), stage_cost(cfg, 1, 0, 0)  # one layer; the LM head alone
    return list(_split(cfg.model.num_layers, chunks, layer, head, EMBEDDING_LAYERS * layer if chunks > pp else 0))


@lru_cache(maxsize=4096)
def _split(num_layers: int, stages: int, layer: int, head: int, embedding: int) -> tuple[int, ...]:
    """best_split of stages costing k * layer, plus ``embedding`` on the first and ``head`` on the last."""
    return tuple(
        best_split(num_layers, stages, lambda s, k: k * layer + (s == 0) * embedding + (s == stages - 1) * head)
    )


def layer_counts(cfg: Config, pp: int) -> list[int]:
    """Decoder layers of each of ``pp`` stages, or of each of the pp*v virtual stages of a chunked schedule in
    virtual-stage order: parallel.pp_layers as given, balanced (auto) or even (empty). The one place the counts
    come from (the stage split, the planner); resolve_layout has checked them."""
    given = cfg.parallel.pp_layers
    if given == "auto":
        return balanced_layers(cfg, pp)
    return list(given) if given else even_layers(cfg.model.num_layers, sched.layer_runs(cfg.parallel, pp))


def rank_ranges(cfg: Config, pp: int, stage: int) -> list[range]:
    """The global layer indices pipeline rank ``stage`` holds: one range per model chunk (one chunk without a
    chunked schedule), as engine/parallel/pp/executor.py split_stage cuts the stage."""
    spec, layers, counts = SCHEDULES[cfg.parallel.schedule], cfg.model.num_layers, layer_counts(cfg, pp)
    if sched.layer_runs(cfg.parallel, pp) == pp:
        return [stage_layer_ranges(layers, pp, counts)[stage]]
    return chunk_layer_ranges(layers, pp, spec.per_rank(cfg.parallel.virtual_stages), spec.vshape, counts)[stage]


def rank_layers(cfg: Config, pp: int, stage: int) -> list[int]:
    """Every decoder layer (global index) that pipeline rank ``stage`` holds, over its chunks."""
    return [i for r in rank_ranges(cfg, pp, stage) for i in r]


def describe(cfg: Config, pp: int) -> str:
    """One line for the log: the chosen split, its stage costs and the even split's slowest stage."""
    chunks = sched.layer_runs(cfg.parallel, pp)
    counts, even = layer_counts(cfg, pp), even_layers(cfg.model.num_layers, chunks)
    unit = "stage" if chunks == pp else "virtual stage"

    def cost(s: int, k: int) -> int:
        return stage_cost(cfg, pp, s, k) if chunks == pp else chunk_cost(cfg, chunks, s, k)

    costs = [cost(s, k) for s, k in enumerate(counts)]
    slowest_even = max(cost(s, k) for s, k in enumerate(even))
    return (
        f"pipeline: parallel.pp_layers={cfg.parallel.pp_layers} -> layers per {unit} {counts}, {unit} cost "
        f"{[round(c / 1e6, 2) for c in costs]} MFLOP/token (slowest {max(costs) / 1e6:.2f}; the even split "
        f"{even}: {slowest_even / 1e6:.2f}, x{slowest_even / max(costs):.2f})"
    )
