"""Memory estimates. Model-state bytes per rank follow Rajbhandari et al. 2020 ("ZeRO", Sec. 5, Fig. 1).

With mixed precision and Adam, each parameter costs 2 bytes of 16-bit weight, 2 of 16-bit gradient and K = 12 of
optimizer state (fp32 master weight, momentum, variance): 16 bytes in all. ZeRO stage 1 shards the optimizer state
over the N data-parallel ranks, stage 2 also the gradients, stage 3 also the weights:
    stage 0: (2 + 2 + K) P      stage 1: (2 + 2) P + K P / N
    stage 2: 2 P + (2 + K) P / N    stage 3: (2 + 2 + K) P / N
In fp32 training (as on CPU) weights and gradients take 4 bytes each and Adam's two moments 8, with no master copy.
"""
from __future__ import annotations

# bytes per parameter: (weights, gradients, optimizer state)
PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


def model_state_bytes(params: int, dp: int, zero_stage: int, precision: str = "mixed") -> float:
    """Bytes of weights + gradients + optimizer state held by one rank for ``params`` parameters over ``dp``
    data-parallel ranks at ZeRO ``zero_stage`` (0 = plain data parallelism; FSDP with resharding is stage 3)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    w, g, k = PRECISIONS[precision]
    sharded = {0: 0, 1: k, 2: g + k, 3: w + g + k}[zero_stage]
    return params * ((w + g + k - sharded) + sharded / dp)
