"""What a checkpoint is made of, handed over explicitly instead of the trainer.

``CheckpointParts`` names the state a rank saves and loads in place: the pipeline stage (its parameters, under the
names a checkpoint uses), the dp mode's access to the parameters and Adam state it holds
(``DataParallel.checkpoint_state``, engine/parallel/dp/base.py), and the config and parallel context that fix the
layout. The run's position (``RunPosition``: optimizer steps taken and global samples consumed) is a value: the
trainer passes it to a save and applies the one a load returns (``step``; ``BatchFeed.seek``). The RNG states of
the rank are the process's own and stay inside engine/checkpoint/contents.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class CheckpointParts:
    model: nn.Module  # this rank's stage: parameters as a checkpoint names them (a DataParallel's ``module``)
    state: Callable[[], object]  # DataParallel.checkpoint_state: held/writes/get/set/prepare/finish/adam_step
    cfg: object  # engine.config.Config
    ctx: object  # engine.parallel.context.ParallelContext


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands: optimizer steps taken, and global samples consumed (the data order's position,
    engine/data/dataset.py GlobalBatchSampler; it differs from step * global_batch_size when that changed)."""
    step: int
    consumed_samples: int
