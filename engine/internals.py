"""The undocumented attributes of DeepSpeed and torch FSDP2 that the engine reads, behind one version check.

Sharded checkpoints (engine/parallel/dp/state.py) locate DeepSpeed's fp32 master partitions and Adam moments through its
ZeRO optimizer's internals (``single_partition_of_fp32_groups``, ``param._hp_mapping``, ``ds_tensor``, ...);
ZeRO.all_reduce_grad reads the gradient attribute DeepSpeed accumulates into; memory accounting
(engine/metrics/memory.py) reads FSDP2's per-parameter records (``module._get_fsdp_state()._fsdp_param_groups``), and
zero bubble's FSDP runs their ``post_backward`` by hand after a chunk's last W (engine/parallel/dp/fsdp.py). None of
these is public API. They were read from the releases in ``TESTED``; a release that renames one fails through
``private`` with one line naming the attribute, the installed version and the tested one (a ConfigError: the
launcher prints it and exits 2) instead of an AttributeError deep inside a save or a step.

    flats = private(optimizer, "deepspeed", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")
"""

from __future__ import annotations

from importlib import metadata

from engine.errors import ConfigError

TESTED = {"deepspeed": "0.19.8", "torch": "2.13.0"}  # the releases these attribute names were read from
_MISSING = object()


class UnsupportedVersion(ConfigError):
    """An internal the engine reads is missing from the installed library; ``str(e)`` is one line."""


def installed_version(lib: str) -> str:
    try:
        return metadata.version(lib)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def private(obj, lib: str, *names: str):
    """``obj.<name>`` for the first of ``names`` that ``obj`` has: an undocumented attribute of ``lib`` (a key of
    TESTED; several names where releases or optimizer classes differ). Raises UnsupportedVersion if none is there.
    A present attribute that is None is returned as None (DeepSpeed sets ``_hp_mapping = None`` on purpose)."""
    for name in names:
        value = getattr(obj, name, _MISSING)
        if value is not _MISSING:
            return value
    wanted = " or ".join(f"{type(obj).__name__}.{n}" for n in names)
    raise UnsupportedVersion(
        f"{wanted} (a {lib} internal the engine reads) is missing in the installed {lib} "
        f"{installed_version(lib)}; the engine is tested with {lib} {TESTED[lib]}: install "
        f"{lib}=={TESTED[lib]} (deepspeed {TESTED['deepspeed']} with torch {TESTED['torch']})"
    )


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (activation checkpointing's recomputed forward runs inside
    one): torch's private ``_current_graph_task_id`` is -1 outside backward (torch 2.13)."""
    import torch

    return torch._C._current_graph_task_id() != -1
