"""Data parallelism: one ``DataParallel`` (engine/parallel/dp/base.py) per dp mode, chosen here by name.

Each mode's DpModeSpec (engine/kinds/dp_modes.py ``MODES``) declares its code, keys, checks, what it composes with,
its planner model and its checkpoint state classes; it names its classes here as "module:class" of this package,
which ``impl_class`` and ``state_classes`` resolve. Everything outside asks the spec and never compares a mode's name.
"""

from __future__ import annotations

import importlib

from engine.kinds.dp_modes import MODES, DpModeSpec


def resolve(name: str) -> type:
    """The class a "module:class" of this package names (a DpModeSpec's impl or state)."""
    module, _, cls = name.partition(":")
    found = getattr(importlib.import_module(f"{__name__}.{module}"), cls, None)
    if found is None:
        raise LookupError(f"no class {cls!r} in engine/parallel/dp/{module}.py (a DpModeSpec names {name!r})")
    return found


def impl_class(spec: DpModeSpec) -> type:
    """The DataParallel class ``spec.impl`` names."""
    return resolve(spec.impl)


def state_classes(spec: DpModeSpec) -> tuple[type, ...]:
    """The checkpoint state classes ``spec.state`` names."""
    return tuple(resolve(name) for name in spec.state)


def build(model, cfg, ctx):
    """Wrap the stage ``model`` (tensor-parallel, materialised, identical on every dp rank) in parallel.dp_mode;
    returns its engine.parallel.dp.base.DataParallel."""
    return impl_class(MODES[cfg.parallel.dp_mode])(model, cfg, ctx)
