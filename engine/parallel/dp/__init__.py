"""Data parallelism: one ``DataParallel`` (engine/parallel/dp/base.py) per dp mode, chosen here by name.

- ``ddp``: torch DistributedDataParallel, bucketed all-reduce overlapped with the last backward (ddp.py)
- ``fsdp``: torch FSDP2, parameters, gradients and Adam state sharded over dp (fsdp.py)
- ``zero``: DeepSpeed ZeRO stages 1-3 (zero.py; its state in zero_state.py, its config in ds_json.py)

A new mode is one file with a DataParallel subclass and one line in ``MODES``. The registry names classes as
strings so that the config checks can list the modes without importing torch, FSDP or DeepSpeed.
"""
from __future__ import annotations

import importlib

MODES = {  # parallel.dp_mode -> "module:class"
    "ddp": "engine.parallel.dp.ddp:DDP",
    "fsdp": "engine.parallel.dp.fsdp:FSDP",
    "zero": "engine.parallel.dp.zero:ZeRO",
}


def build(model, cfg, ctx):
    """Wrap the stage ``model`` (tensor-parallel, materialised, identical on every dp rank) in parallel.dp_mode;
    returns its engine.parallel.dp.base.DataParallel."""
    module, _, name = MODES[cfg.parallel.dp_mode].partition(":")
    return getattr(importlib.import_module(module), name)(model, cfg, ctx)
