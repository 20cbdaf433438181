"""The straggler report (log.straggler_ratio): every ``log.every`` steps, each rank's phase times since the last report
go to rank 0 in one small gather, and a rank or host whose compute is slower than its peers' median by more than the
ratio is named in the log, in metrics.jsonl and in TensorBoard, with what it costs the step:

    straggler: host h2 (ranks 4-7) forward 1.8x the median over steps 11-20; costs ~22% of the step

Each rank sends, per phase, its median over the report's steps (a step the scheduler preempted is an outlier a
median ignores; a straggler is slow at every step), leaving out a process's first step (lazy initialisation,
compilation); a logged step with fewer than ``MIN_STEPS`` steps since the last report waits for more (at log.every
1, the default, a report every 4 steps). A rank's peers are the ranks of its pipeline stage (stages do different
work: the first embeds, the last computes the loss), and its median is theirs without it. Compute is the forward,
backward and optimizer phases (engine/metrics/timers.py); the median pp_wait and dp_comm go to metrics.jsonl beside
the findings.

A phase includes the collectives that run inside it (tp's in forward and backward, ddp's gradient all-reduce in the
last backward, the norm's all-reduce in the optimizer), so a straggler's peers wait for it there: under ddp a rank
slow in forward makes the others' backward as slow. Only the ranks slow in the earliest slow phase of the step are
named; a rank slow only in a later phase is taken for one that waited. A rank slow in the same phase its partners
wait in shows against the other groups (a whole tp group is named), or not at all where every rank waits for it (a
rank slow only in backward under ddp at tp 1). Its cost is its excess over the median, summed over its compute
phases, over the median step time: what the step waits for it. A finding that costs under ``MIN_COST`` of the step
is noise (a phase of a few milliseconds), not named.

Cost at N ranks: one gather of ``len(FIELDS)`` floats per rank to rank 0 per report (O(1) per rank, O(N) at rank 0),
no per-step collective; rank 0 sorts each stage's values once (O(N log N), vectorised: 12 ms of CPU for a synthetic
table of 16,384 ranks in 8 stages, 1 MB gathered).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engine.storage import say
from engine.trust.replicas import span

COMPUTE = ("forward", "backward", "optimizer")
PER_STEP = (*COMPUTE, "pp_wait", "dp_comm", "step_time")  # a rank's median over the steps of a report
FIELDS = (*PER_STEP, "steps", "stage")
MIN_COST = 0.02  # a finding that costs under 2 % of the step is not named
MIN_STEPS = 4  # a report waits for this many steps (log.every 1: every 4th step): a median of one step is noise
MAX_LINES = 3  # named per report; more are counted


class StragglerReport:
    """One per Trainer: ``add(record)`` after each step, ``report(record)`` at each logged step (every rank, at the
    same steps: it is a collective), which on rank 0 adds the findings to the record and prints them."""

    def __init__(self, cfg, ctx):
        self.ratio, self.ctx = cfg.log.straggler_ratio, ctx
        # off: no ratio, no phase times (log.breakdown false), or no peers to compare with
        self.enabled = bool(self.ratio) and cfg.log.breakdown and ctx.world_size > 1
        self.stage = ctx.axis_rank("pp")
        self.local = ranks_per_host(ctx.world_size)
        self.rows: list[list[float]] = []  # per step since the last report: PER_STEP values
        self.first = None  # the first step since the last report

    def add(self, record: dict) -> None:
        if not self.enabled or record.get("warmup"):  # a process's first step: lazy init, first touch, compile
            return
        self.first = record["step"] if self.first is None else self.first
        phases = record.get("time") or {}
        self.rows.append([phases.get(name, 0.0) for name in PER_STEP[:-1]] + [record["step_time"]])

    def report(self, record: dict) -> None:
        """Gather each rank's per-step medians to rank 0 and start over; rank 0 names the stragglers in ``record``."""
        if not self.enabled or len(self.rows) < MIN_STEPS:  # the same count on every rank
            return
        medians = torch.tensor(self.rows, dtype=torch.float64).median(dim=0).values.tolist()
        mine = torch.tensor([*medians, len(self.rows), self.stage], dtype=torch.float64, device=self.ctx.device)
        table = [torch.empty_like(mine) for _ in range(self.ctx.world_size)] if self.ctx.rank == 0 else None
        dist.gather(mine, table, dst=0)
        steps, self.first, self.rows = (self.first, record["step"]), None, []
        if self.ctx.rank != 0:
            return
        found = find(torch.stack(table).cpu(), self.ratio, self.local)
        record.update(found["metrics"])
        for line in log_lines(found["named"], steps):
            say(line)


def ranks_per_host(world_size: int) -> int:
    """Ranks per host as the launchers number them (torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's
    LOCAL_SIZE: host i holds ranks i*L .. i*L+L-1); unset (forked ranks): one host."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or ""
    return int(value) if value.isdigit() and int(value) > 0 else world_size


def median_of_others(values: torch.Tensor) -> torch.Tensor:
    """(n, k) -> (n, k): for each row, the column medians of the other n - 1 rows (the row itself with n = 1).
    Sorted once: without row i, the j-th smallest of the rest is the j-th or the (j+1)-th of all."""
    n = values.shape[0]
    if n == 1:
        return values.clone()
    s, order = values.sort(dim=0)
    position = torch.empty_like(order)
    position.scatter_(0, order, torch.arange(n).unsqueeze(1).expand_as(order))

    def kth(k: int) -> torch.Tensor:  # the k-th smallest of the others, per row
        return torch.where(position > k, s[k], s[min(k + 1, n - 1)])

    m = n - 1
    return kth(m // 2) if m % 2 else (kth(m // 2 - 1) + kth(m // 2)) / 2


def find(table: torch.Tensor, ratio: float, local: int) -> dict:
    """table: (ranks, FIELDS), each rank's medians over the report's steps. Returns ``named`` (one dict per
    straggling rank, or per host all of whose ranks straggle) and the record's ``metrics``.

    A rank's phase is slow when it is over ``ratio`` times its stage peers' median and the excess costs at least
    MIN_COST of the median step. Only the ranks slow in the earliest such phase of the step (forward, backward,
    optimizer) are named: their peers wait for them in the next collective, inside a later phase (under ddp a rank
    slow in forward makes the others' backward, where the gradient all-reduce waits, as slow), so a rank slow only
    in a later phase than another is taken for one that waited."""
    col = {name: i for i, name in enumerate(FIELDS)}
    compute = table[:, [col[p] for p in COMPUTE]]
    median = torch.empty_like(compute)
    for stage in table[:, col["stage"]].unique():
        rows = table[:, col["stage"]] == stage
        median[rows] = median_of_others(compute[rows])
    rel = torch.where(median > 0, compute / median.clamp_min(1e-12), torch.ones_like(compute))
    excess = (compute - median).clamp_min(0) / table[:, col["step_time"]].median().clamp_min(1e-12)
    slow = (rel > ratio) & (excess >= MIN_COST)  # (ranks, phases)
    phases = slow.any(dim=0).nonzero().flatten().tolist()
    ranks = slow[:, phases[0]].nonzero().flatten().tolist() if phases else []
    cost = excess.sum(dim=1)
    metrics = {
        "straggler_ratio": round(float(rel.max()), 3),
        "straggler_cost": round(float(cost[ranks].max()) if ranks else 0.0, 4),
        "time_wait_median": {w: round(float(table[:, col[w]].median()), 6) for w in ("pp_wait", "dp_comm")},
    }
    named = group_by_host(ranks, local, table.shape[0], phases[0] if phases else 0, rel, cost)
    if named:
        metrics["stragglers"] = named
    return {"named": named, "metrics": metrics}


def group_by_host(slow: list[int], local: int, world: int, phase: int, rel, cost) -> list[dict]:
    """One finding per host whose every rank straggles (more than one rank a host), else one per rank; each with
    the phase, its ratio (a host's: its slowest rank's) and the cost (a host's: its slowest rank's, as the step
    waits for that one)."""
    found, hosts = [], {}
    for r in slow:
        hosts.setdefault(r // local, []).append(r)
    for host, ranks in sorted(hosts.items()):
        whole = local > 1 and len(ranks) == min(local, world - host * local)
        for members in [ranks] if whole else [[r] for r in ranks]:
            found.append(
                {
                    "host": f"h{host}",
                    "ranks": members,
                    "whole_host": whole,
                    "phase": COMPUTE[phase],
                    "ratio": round(max(float(rel[r, phase]) for r in members), 2),
                    "cost": round(max(float(cost[r]) for r in members), 4),
                }
            )
    return sorted(found, key=lambda f: -f["cost"])


def log_lines(named: list[dict], steps: tuple[int, int]) -> list[str]:
    """A report's lines in the log: the first MAX_LINES findings (the costliest: find sorts them), the rest counted
    (every one is in metrics.jsonl)."""
    lines = [describe(f, steps) for f in named]
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES] + [f"straggler: and {len(lines) - MAX_LINES} more (metrics.jsonl)"]
    return lines


def describe(finding: dict, steps: tuple[int, int]) -> str:
    """'straggler: host h2 (ranks 4-7) forward 1.8x the median over steps 11-20; costs ~22% of the step'."""
    ranks = finding["ranks"]
    who = (
        f"host {finding['host']} (ranks {span(ranks)})"
        if finding["whole_host"]
        else f"rank {ranks[0]} (host {finding['host']})"
    )
    over = f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"
    return (
        f"straggler: {who} {finding['phase']} {finding['ratio']:.1f}x the median over {over}; "
        f"costs ~{100 * finding['cost']:.0f}% of the step"
    )
