"""Every kind of the engine, declared once: the names a config may give ``model.family``, ``parallel.cp_mode``,
``train.activation_checkpointing`` and ``parallel.offload``, each mapped to a spec of what that name means, which
the config checks, the model, the layout checks, the planner and the search ask instead of comparing the name
(tests/test_kind_names.py). The bottom floor: no torch, and nothing imported from above it (engine/errors.py only),
so loading a config reads these before any process exists.

| kind                             | registry                         | spec                               |
|----------------------------------|----------------------------------|------------------------------------|
| model.family                     | ``families.FAMILIES``            | ``FamilySpec`` (+ ``MoeSpec``)     |
| parallel.cp_mode                 | ``cp_modes.CP_MODES``            | ``CpModeSpec``                     |
| train.activation_checkpointing   | ``recompute.RECOMPUTE``          | ``RecomputeSpec``                  |
| parallel.offload                 | ``offload.OFFLOADS``             | ``OffloadSpec``                    |
| parallel.dp_mode                 | engine/parallel/dp ``MODES``     | ``DpModeSpec`` (dp/registry.py)    |
| parallel.schedule                | engine/parallel/pp/schedule ``SCHEDULES`` | ``ScheduleSpec`` (pp/actions.py) |

dp modes and schedules keep their registries in their packages (torch-free too): their specs hold their checks
(engine/parallel/dp/checks.py) and table builders, which read the schedule vocabulary of engine/parallel/pp/actions.py.
A spec names the code of its kind that lives higher up (a cp mode's attention core, a planner model) as a
"module:name" string, imported where it is used (``load``), so this floor imports nothing above it.
A new kind of an existing sort is one spec here plus its code: docs/recipes.md.
"""

from __future__ import annotations

import importlib


def load(path: str):
    """The object a "module:name" string names (imported now)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
