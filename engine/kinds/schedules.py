"""Pipeline schedules: one ``ScheduleSpec`` per ``parallel.schedule``, registered in ``SCHEDULES``, so that the
layout checks, the config checks, the dp modes, the planner and the search ask the schedule instead of comparing its
name. Each names its table builder (the per-rank action list, engine/parallel/pp/schedule.py and pp/schedules/, one
file per schedule beyond 1F1B and GPipe), which engine/parallel/pp/schedule.py ``table_builder`` resolves, and
carries its papers' bubble formula (``theory``) and the point where the dp gradient sync must run. No torch: the
config checks read it. A new schedule is its table function and one spec here (docs/recipes.md).

- 1f1b (PipeDream-Flush) and gpipe: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", Sec. 2.2.1; Huang et al. 2019, "GPipe".
- interleaved: 1F1B over v model chunks per rank, Narayanan et al. 2021, Sec. 2.2.2.
- zero_bubble: ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1.
- zbv: ZB-V, Qi et al. 2023, Sec. 6: two chunks per rank in a V, F/B/W split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# When a schedule needs the dp gradient sync to run (ScheduleSpec.grad_sync); each dp mode declares the ones it can
# follow (engine/kinds/dp_modes.py DpModeSpec.grad_syncs).
LAST_BACKWARD, CHUNK_BACKWARD, LAST_W = (
    "the last backward",
    "each model chunk's last backward",
    "the last W, not the last B",
)
# ZB-V: each of a rank's 2 chunks completes its gradients at its own last W, and rank 0's chunks share a tied
# embedding, whose gradient is complete only after both (DDP reduces it once, after the step: dp/ddp.py).
CHUNK_LAST_W = "each of its 2 chunks' last W"


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is and needs, registered in SCHEDULES. ``table``: the name of its table builder, ``(pp,
    micro_batches, stage, v) -> list[Action]`` (engine/parallel/pp/schedule.py ``table_builder`` resolves it).
    ``grad_sync``: when the dp gradient sync must run (a dp mode that cannot follow it is refused).
    ``m_at_least_pp``: needs micro_batches >= pp. ``chunks``: runs v >= 2 model chunks per rank
    (parallel.virtual_stages; micro_batches a multiple of pp, layers split evenly into pp*v chunks). ``vshape``: runs
    2 chunks per rank placed in a V (rank r: virtual stages r and 2pp-1-r; parallel.virtual_stages implied, 1 or 2
    accepted; layers split evenly into 2pp chunks; the last virtual stage, with the head, on rank 0). ``split_w``:
    splits the backward into B and W (W state held until W, gradients complete only after the last W).
    ``searched``: the virtual stage counts the planner tries (): not searched). ``label``: its short name in tables,
    "{v}" standing for v. ``theory(pp, m, v, f, b, bi, w)``: the papers' (formula, bubble fraction). ``unit``: what
    one in-flight count is, printed after the counts."""

    name: str
    table: str
    grad_sync: str
    theory: Callable[..., tuple[str, float]]
    m_at_least_pp: bool = False
    chunks: bool = False
    vshape: bool = False
    split_w: bool = False
    searched: tuple[int, ...] = ()
    label: str = ""
    unit: str = ""

    def per_rank(self, v: int) -> int:
        """Model chunks each rank runs, given parallel.virtual_stages=v: v with chunks, 2 in a V, else 1."""
        return 2 if self.vshape else v if self.chunks else 1

    def short(self, v: int) -> str:
        """Its label in tables: 1f1b, gpipe, il-v2 (interleaved, 2 virtual stages), zb-h1."""
        return (self.label or self.name).replace("{v}", str(v))


def flush_theory(pp: int, m: int, v: int, f: float, b: float, bi: float, w: float) -> tuple[str, float]:
    """1F1B and GPipe: (p-1)/(m+p-1) of the makespan (Narayanan et al. 2021, Sec. 2.2.1)."""
    return "(p-1)/(m+p-1)", (pp - 1) / (m + pp - 1)


def interleaved_theory(pp: int, m: int, v: int, f: float, b: float, bi: float, w: float) -> tuple[str, float]:
    """Narayanan et al. 2021, Sec. 2.2.2: a bubble of (p-1)/(v*m) of the ideal time."""
    return "(p-1)/(v*m+p-1)", (pp - 1) / (v * m + pp - 1)


def zb_theory(pp: int, m: int, v: int, f: float, b: float, bi: float, w: float) -> tuple[str, float]:
    """Qi et al. 2023, Sec. 3.1: a bubble of (p-1)(F+B-W) against m(F+B+W) of work."""
    bubble = (pp - 1) * (f + bi - w)
    return "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))", bubble / (m * (f + bi + w) + bubble)


def zbv_theory(pp: int, m: int, v: int, f: float, b: float, bi: float, w: float) -> tuple[str, float]:
    """torch's ZBV order leaves rank r idle (p-1) chunk F's in all (simulated at F = B = W;
    engine/parallel/pp/schedules/zbv.py's docstring)."""
    bubble = (pp - 1) * f
    return "(p-1)F/(2m(F+B+W)+(p-1)F), F=B=W, m>=2p-1", bubble / (2 * m * (f + bi + w) + bubble)


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (  # parallel.schedule -> its ScheduleSpec
        ScheduleSpec("1f1b", "one_f_one_b", LAST_BACKWARD, flush_theory, m_at_least_pp=True, searched=(1,)),
        # Not searched by the planner: 1F1B's makespan with m instead of pp - stage micro-batches held.
        ScheduleSpec("gpipe", "gpipe", LAST_BACKWARD, flush_theory),
        # Each chunk's gradients are complete after that chunk's last backward, which is where the dp sync must run.
        ScheduleSpec(
            "interleaved",
            "interleaved_1f1b",
            CHUNK_BACKWARD,
            interleaved_theory,
            chunks=True,
            searched=(2, 3, 4),
            label="il-v{v}",
            unit="  (chunk micro-batches, each 1/{v} of a stage's)",
        ),
        # Its gradients are complete only after the last W, so the dp sync must follow that, not the last B.
        ScheduleSpec(
            "zero_bubble",
            "zb_h1",
            LAST_W,
            zb_theory,
            m_at_least_pp=True,
            split_w=True,
            searched=(1,),
            label="zb-h1",
            unit="  (held until W)",
        ),
        # Each chunk's gradients are complete after its own last W; 2 chunks in a V, implied (virtual_stages 1 or 2).
        ScheduleSpec(
            "zbv",
            "zbv",
            CHUNK_LAST_W,
            zbv_theory,
            vshape=True,
            split_w=True,
            searched=(2,),
            label="zbv",
            unit="  (chunk micro-batches held until W, each 1/2 of a stage's)",
        ),
    )
}
