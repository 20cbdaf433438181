"""Memory of one training step, measured on any device: the harness that checks engine/planning/planner.py.

``measure_step(trainer, local_batch)`` runs one ``Trainer.train_step`` under engine/metrics/memory.py's counters
(tensors held, saved for backward, live allocations), sampling gradients and FSDP's gathered weights before each
backward and before the update through ``Trainer.observers``. Used by tests/planning/test_planner.py and
launch/bench/tp.py.
"""

from __future__ import annotations

import torch

from engine.metrics.memory import (
    LiveTensorBytes,
    SavedActivations,
    fsdp_params,
    gathered_weight_bytes,
    tensor_bytes_held,
)


def measure_step(trainer, local_batch: torch.Tensor | None) -> dict[str, int]:
    """One ``trainer.train_step(local_batch)`` (an engine.trainer.Trainer whose optimizer state an earlier step has
    created), measured. Returns bytes: params, grads (the most held before any backward or before the optimizer
    step: FSDP with parallel.fsdp_grad_accumulation=unsharded holds them unsharded until the last micro-batch),
    optimizer, activations (peak saved for backward), gathered (peak FSDP all-gathered weights), before (held at the
    start), peak (before + the peak of storages allocated during the step: activations, gradients, communication
    and optimizer temporaries) and backward_peak (the same until the optimizer step begins)."""
    model = trainer.model
    held = tensor_bytes_held(model, trainer.optimizer)
    records = fsdp_params(model)
    grads, gathered = [held["grads"]], [gathered_weight_bytes(records)]

    backward_peak = [0]

    def sample() -> None:
        grads.append(tensor_bytes_held(model)["grads"])
        gathered.append(gathered_weight_bytes(records))
        backward_peak[0] = live.peak  # before the optimizer step: the forward/backward's peak so far

    live = LiveTensorBytes(extra=(lambda: gathered_weight_bytes(records)) if records else None)
    saved = SavedActivations(model, on_event=lambda: records and gathered.append(gathered_weight_bytes(records)))
    trainer.observers.append(lambda event: sample())  # before each backward and before the update
    try:
        with live, saved.hooks():
            trainer.train_step(local_batch)
    finally:
        trainer.observers.pop()
    before = sum(held.values())
    return {
        "params": held["params"],
        "grads": max(grads),
        "optimizer": held["optimizer"],
        "activations": saved.peak,
        "gathered": max(gathered),
        "before": before,
        "backward_peak": before + backward_peak[0],
        "peak": before + live.peak,
    }


def measure_rank(argv: list[str]) -> dict:
    """Rank function (engine.parallel.layout.spawn.run_ranks): build the Trainer of ``argv`` as launch/pretrain.py does,
    run two steps (AdamW's state exists, DDP has rebuilt its buckets), then measure_step on the next batch.
    Returns the measurement with the rank's pp stage, tp rank and world size."""
    from engine.config import load
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    cfg = load(argv)
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    for _ in range(2):  # AdamW creates its state in the first step; DDP rebuilds its buckets in the second
        trainer.train_step(trainer.next_local_batch())
    measured = measure_step(trainer, trainer.next_local_batch())
    return {**measured, "stage": ctx.pp_rank, "tp_rank": ctx.tp_rank, "world_size": ctx.world_size}
