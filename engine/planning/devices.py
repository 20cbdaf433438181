"""The planner's device kinds: per kind, the fraction of the datasheet peak its matmuls achieve (``efficiency``,
engine/planning/search.py Hardware) and the links of its usual node, each with where the figure comes from.

``efficiency`` is what the step-time model multiplies the peak by for compute (engine.model.flops.DEVICE_PEAKS);
the bubble and the exposed communication come on top, so it sits above a paper's end-to-end MFU. The defaults are
calibrated on the published runs that tests/planning/data/published.json keeps (their sources there): the value at
which the planner's throughput of those runs is closest to the published one (tests/planning/test_published.py
checks each within 15 %). Where a GPU is at hand, measure it instead: ``launch/bench/step.py --side ours --json-out
F`` on one device writes ``efficiency`` (hardware FLOP/s over the peak, no communication at tp = pp = dp = 1) and
``launch/plan.py --efficiency-from F`` plans with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceKind:
    """One kind: the name patterns that select it (all lower-case substrings of torch.cuda.get_device_name, as in
    engine.model.flops.DEVICE_PEAKS), its matmul efficiency, its links (GB/s per device per direction) and sources."""

    patterns: tuple[str, ...]
    efficiency: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    source: str


# The first kind whose patterns all occur in the lower-cased device name wins.
KINDS: dict[str, DeviceKind] = {
    "a100": DeviceKind(
        ("a100",),
        0.5,
        8,
        300.0,
        25.0,
        "Narayanan et al. 2021 (arXiv:2104.04473) Table 1: 44-52 % of the 312 TFLOP/s peak end to end on DGX A100 "
        "(NVLink 3 at 300 GB/s per direction, 8 x 200 Gb/s HDR InfiniBand per node); at 0.5 the planner gives "
        "1.14x its 1.7B row, 1.09x 3.6B, 1.01x 7.5B and 18.4B, 0.92x 39.1B",
    ),
    "h100": DeviceKind(
        ("h100",),
        0.45,
        8,
        450.0,
        50.0,
        "TorchTitan docs/performance.md: Llama 3.1 8B with eager FSDP (as this engine runs) at 33-39 % MFU on 8-128 "
        "H100s; at 0.45 of the NVL peak their footnote bounds their 500 W parts by, the planner gives 1.04x their "
        "tokens/s; Llama 3 paper (arXiv:2407.21783) Table 4: 38-43 % BF16 MFU with Meta's own stack on 8,192-16,384 "
        "(NVLink 4 at 450 GB/s, 400 Gb/s per GPU between nodes)",
    ),
    "h200": DeviceKind(
        ("h200",),
        0.45,
        8,
        450.0,
        50.0,
        "H100's: the same compute and NVLink 4 (NVIDIA H200 datasheet); no published run of our shapes on it",
    ),
    "cpu": DeviceKind(
        ("cpu",),
        1.0,
        1,
        10.0,
        10.0,
        "no datasheet peak: give --peak-tflops as the TFLOP/s launch/bench/step.py measures on the machine "
        "(its 'tflops'), which already is the achieved rate, so the efficiency is 1",
    ),
}


def device_kind(name: str) -> str | None:
    """The kind of ``name`` (a torch.cuda.get_device_name or "cpu"), or None when no kind matches."""
    low = name.lower()
    for kind, spec in KINDS.items():
        if all(p in low for p in spec.patterns):
            return kind
    return None


def default_efficiency(name: str) -> float | None:
    """The efficiency the planner uses for device ``name`` when none is given (None for an unknown kind)."""
    kind = device_kind(name)
    return KINDS[kind].efficiency if kind else None
