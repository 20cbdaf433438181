"""Host offload (ZeRO-Offload, Ren et al. 2021): one ``OffloadSpec`` per ``parallel.offload``, registered in
``OFFLOADS`` (the config's choices, in this order). Which dp mode honours which is the mode's (DpModeSpec.offload,
engine/parallel/dp/); what moves is the spec's, which the config checks, the dp modes, their planner models and the
search ask instead of comparing the name. No torch: the config checks read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadSpec:
    """One value. ``optimizer``: the fp32 Adam state (and master weights) live on the host and the step runs there;
    ``params``: the weights too (ZeRO-3's offload_param, FSDP2's CPUOffloadPolicy). ``label``: its suffix in the
    search's dp-mode column (launch/plan.py)."""

    name: str
    optimizer: bool = False
    params: bool = False
    label: str = ""

    @property
    def offloads(self) -> bool:
        """Anything moves to the host."""
        return self.optimizer or self.params


OFFLOADS: dict[str, OffloadSpec] = {
    s.name: s
    for s in (  # parallel.offload -> its OffloadSpec
        OffloadSpec("none"),
        OffloadSpec("optimizer", optimizer=True, label="+off-opt"),
        OffloadSpec("optimizer_and_params", optimizer=True, params=True, label="+off-all"),
    )
}
