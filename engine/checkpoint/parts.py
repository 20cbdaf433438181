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
from typing import TYPE_CHECKING, Callable

from torch import nn

if TYPE_CHECKING:
    from engine.config import Config
    from engine.parallel.dp.state import CheckpointState
    from engine.parallel.layout.context import ParallelContext


@dataclass(frozen=True)
class CheckpointParts:
    """The state of one rank that a save reads and a load overwrites in place."""

    model: nn.Module  # this rank's stage: parameters as a checkpoint names them (a DataParallel's ``module``)
    state: Callable[[], CheckpointState]  # DataParallel.checkpoint_state (engine/parallel/dp/state.py's protocol)
    cfg: Config
    ctx: ParallelContext


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands: optimizer steps taken, and global samples consumed (the position in the global sample
    order, engine/data/dataset.py GlobalBatchSampler; recorded as it is, not derived from the step)."""

    step: int
    consumed_samples: int
