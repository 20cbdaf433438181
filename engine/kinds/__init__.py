"""Every kind of the engine, declared once: the names a config may give ``model.family``, ``parallel.cp_mode``,
``train.activation_checkpointing``, ``parallel.offload``, ``parallel.dp_mode`` and ``parallel.schedule``, each mapped
to a spec of what that name means, which the config checks, the model, the layout checks, the planner and the search
ask instead of comparing the name (tests/test_kind_names.py). The bottom floor: no torch, and nothing imported from
above it (engine/errors.py and engine/json_input.py only), so loading a config reads these before any process
exists.

| kind                             | registry                         | spec                               |
|----------------------------------|----------------------------------|------------------------------------|
| model.family                     | ``families.FAMILIES``            | ``FamilySpec`` (+ ``MoeSpec``)     |
| parallel.cp_mode                 | ``cp_modes.CP_MODES``            | ``CpModeSpec``                     |
| train.activation_checkpointing   | ``recompute.RECOMPUTE``          | ``RecomputeSpec``                  |
| parallel.offload                 | ``offload.OFFLOADS``             | ``OffloadSpec``                    |
| parallel.dp_mode                 | ``dp_modes.MODES``               | ``DpModeSpec`` (checks: dp_checks) |
| parallel.schedule                | ``schedules.SCHEDULES``          | ``ScheduleSpec``                   |

A spec names its code on a higher floor by a name that floor resolves, never by an engine path (a cp mode's
attention core: engine/parallel/cp/apply.py ``core_class``; a planner model: engine/planning/cp.py and dp.py
``model_class``; a dp mode's classes: engine/parallel/dp ``impl_class``, ``state_classes``; a schedule's table:
engine/parallel/pp/schedule.py ``table_builder``), so this floor imports nothing above it and tests/test_kind_names.py
resolves every name. ds_config.py is the zero mode's DeepSpeed configuration (its defaults and the user's file),
which its checks read. A new kind of an existing sort is one spec here plus its code: docs/recipes.md.
"""

from __future__ import annotations
