"""``train.compile: true``: torch.compile each decoder block (Ansel et al. 2024, "PyTorch 2").

Per block rather than the whole model, as torchtitan does: the blocks are identical, so one compiled graph serves
all of them (parameters are graph inputs), compile time does not grow with depth, and pipeline stages and FSDP
units (one per block) keep their boundaries. Order (torchtitan's parallelize_llama): tensor parallelism, then
activation checkpointing (engine/model/recompute.py; the checkpoint runs inside the compiled block, so selective
recomputation's policy is applied by the compiler), then compile, then FSDP. ``nn.Module.compile`` compiles in
place: parameter names and the module tree stay as they are (checkpoints and HF export see no wrapper).

The combinations that do not work are refused by engine/config_checks.py.
"""

from __future__ import annotations

import torch
from torch import nn

# torch.compile keeps one cache entry per distinct guard set of a code object; the blocks share one, and
# recompiles come from micro-batch shape changes (evaluation, a short last batch). Beyond this, eager.
CACHE_SIZE_LIMIT = 16


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile every decoder block of ``model`` (a Llama or one of its pipeline stages) in place."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)
    for layer in model.model.layers.values():
        layer.compile(backend=backend)
