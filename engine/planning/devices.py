"""The planner's device kinds: per kind, the fraction of the datasheet peak its matmuls achieve (``efficiency``,
engine/planning/search.py Hardware) and the links of its usual node, and per part its memory bandwidth (``hbm_gbps``),
each with where the figure comes from.

The step-time model prices a block's matmuls at ``efficiency`` of the peak (engine.model.flops.DEVICE_PEAKS) and its
element-wise kernels at the memory bandwidth (engine/planning/kernels.py: a roofline per kernel class), so the
share of the peak a step achieves rises with the matrix sizes (the matmuls grow as h^2 / t, the element-wise bytes
as h); the bubble and the exposed communication come on top. ``efficiency`` is the one calibrated constant per kind,
fitted on the SMALL published runs of its kind only (tests/planning/data/published.json, sources there): the value
at which the geometric mean of the planner's / published tokens/s over those runs is 1 (A100: Narayanan et al. 2021
Table 1's 1.7B-18.4B rows; H100: TorchTitan's Llama 3.1 8B rows); the larger runs (A100 39.1B-1T, H100 Llama 3 405B)
are the held-out check (tests/planning/test_published.py, each within 15 %). Where a GPU is at hand, measure it
instead: ``launch/bench/step.py --side ours --json-out F`` on one device writes ``efficiency`` (hardware FLOP/s over
the peak, no communication at tp = pp = dp = 1) and ``launch/plan.py --efficiency-from F`` plans with it (that
measure includes the element-wise kernels: plan it with --hbm-gbps 0).
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
        0.582,
        8,
        300.0,
        25.0,
        "Narayanan et al. 2021 (arXiv:2104.04473) Table 1: 44-52 % of the 312 TFLOP/s peak end to end on DGX A100 "
        "(NVLink 3 at 300 GB/s per direction, 8 x 200 Gb/s HDR InfiniBand per node); 0.582 with the element-wise "
        "kernels at 2,039 GB/s, their Megatron's materialised attention scores included (Hardware."
        "materialised_scores) and the tp collectives the model runs (engine/planning/tp.py), puts the geometric "
        "mean of its 1.7B-18.4B rows at 1.00x; the rows from 39.1B to 1T are held out",
    ),
    "h100": DeviceKind(
        ("h100",),
        0.477,
        8,
        450.0,
        50.0,
        "TorchTitan docs/performance.md: Llama 3.1 8B with eager FSDP (as this engine runs) at 33-39 % MFU on 8-128 "
        "H100s; 0.477 of the NVL peak their footnote bounds their 500 W parts by (and the NVL's 3.9 TB/s) puts the "
        "geometric mean of those two rows at 1.00x; the Llama 3 405B rows are held out; Llama 3 paper "
        "(arXiv:2407.21783) Table 4: 38-43 % BF16 MFU with Meta's own stack on 8,192-16,384 "
        "(NVLink 4 at 450 GB/s, 400 Gb/s per GPU between nodes)",
    ),
    "h200": DeviceKind(
        ("h200",),
        0.477,
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


# Device memory bandwidth in GB/s by part, for the element-wise kernels (engine/planning/kernels.py; Hardware.hbm_gbps):
# (name patterns, GB/s), the first row whose patterns all occur in the lower-cased name winning, as DEVICE_PEAKS.
# Sources: NVIDIA's A100 datasheet (40GB 1,555; 80GB PCIe 1,935; 80GB SXM 2,039), H100 datasheet (SXM 3.35 TB/s,
# PCIe 2 TB/s, NVL 3.9 TB/s) and H200 datasheet (4.8 TB/s). A CPU's --peak-tflops is a measured rate that already
# includes its element-wise work: none (0, not modelled).
HBM_GBPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("a100", "40gb"), 1555.0),
    (("a100", "pcie"), 1935.0),
    (("a100",), 2039.0),
    (("h100", "nvl"), 3900.0),
    (("h100", "pcie"), 2000.0),
    (("h100",), 3350.0),
    (("h200",), 4800.0),
)


def hbm_gbps(name: str) -> float:
    """Device memory bandwidth of ``name`` in GB/s (HBM_GBPS), 0 where unknown (the planner then prices no
    element-wise kernel)."""
    low = name.lower()
    return next((gbps for patterns, gbps in HBM_GBPS if all(p in low for p in patterns)), 0.0)


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
