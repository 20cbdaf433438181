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
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import Config
from engine.model.flops import stage_flops_per_token
from engine.parallel.pp.split import even_layers


def stage_cost(cfg: Config, pp: int, stage: int, layers: int) -> int:
    """FLOPs per token of pipeline ``stage`` holding ``layers`` decoder layers (the LM head on the last stage)."""
    return stage_flops_per_token(
        cfg.model, cfg.train.seq_len, layers, stage == pp - 1, cfg.train.activation_checkpointing
    )


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
    """The split minimising the slowest stage's FLOPs per token (parallel.pp_layers: auto)."""
    return best_split(cfg.model.num_layers, pp, lambda s, k: stage_cost(cfg, pp, s, k))


def layer_counts(cfg: Config, pp: int) -> list[int]:
    """Decoder layers of each of ``pp`` stages: parallel.pp_layers as given, balanced (auto) or even (empty). The
    one place the counts come from (the stage split, the planner); resolve_layout has checked them."""
    given = cfg.parallel.pp_layers
    if given == "auto":
        return balanced_layers(cfg, pp)
    return list(given) if given else even_layers(cfg.model.num_layers, pp)


def describe(cfg: Config, pp: int) -> str:
    """One line for the log: the chosen split, its stage costs and the even split's slowest stage."""
    counts, even = layer_counts(cfg, pp), even_layers(cfg.model.num_layers, pp)
    costs = [stage_cost(cfg, pp, s, k) for s, k in enumerate(counts)]
    slowest_even = max(stage_cost(cfg, pp, s, k) for s, k in enumerate(even))
    return (
        f"pipeline: parallel.pp_layers={cfg.parallel.pp_layers} -> layers per stage {counts}, stage cost "
        f"{[round(c / 1e6, 2) for c in costs]} MFLOP/token (slowest {max(costs) / 1e6:.2f}; the even split "
        f"{even}: {slowest_even / 1e6:.2f}, x{slowest_even / max(costs):.2f})"
    )
