"""What a pipeline schedule (engine/parallel/pp/schedule.py) implies for the plan: one rank's activations in flight,
in bytes, and the step's makespan, both read off the schedule's own tables rather than a 1F1B closed form.

Memory: walk the rank's action list (once per table: held_states) and price what is alive after each compute:
- FWD of (micro-batch, chunk) adds that chunk's activations of one micro-batch (engine/planning/activations.py
  for the chunk's layers). Without virtual stages the one chunk is the whole stage. Interleaved 1F1B
  (Narayanan et al. 2021, Sec. 2.2.2): the layers are split into pp*v chunks (equal, or parallel.pp_layers') and
  rank r holds chunks r, r+pp, ... (engine/parallel/pp/actions.py), each priced for its own layers; virtual
  stage 0 (chunk 0 of rank 0) also keeps the token ids of the embedding, the last virtual stage (chunk v-1 of
  rank pp-1) the final norm, logits and loss, and every chunk but virtual stage 0 its received input (bf16) and
  its own RoPE tables (built per forward).
- BWD releases them. Under zero bubble (Qi et al. 2023, Sec. 2) B (BWD_INPUT) releases them too (autograd frees
  the graph) but leaves the W state (engine/parallel/autograd/weight_grad.py), which W (BWD_WEIGHT) releases: for every
  split linear its input x and output gradient g, in the matmul dtype. Per token of a block, x: the norm output
  for the fused q/k/v (h), the attention output (a hd/t), the norm output for the fused gate/up (h), the SwiGLU
  product (f/t); g: q, k, v (a hd/t, kvd/t,
  kvd/t), o and down (h each), gate and up (f/t each). The LM head is not split (its g would be logits-sized).
The peak is taken after each compute; the count of pairs held is engine.parallel.pp.actions.max_in_flight's, the one
count the simulator reports too.

Time: engine.parallel.pp.simulator's event simulation of the schedule with the planner's per-micro-batch costs
of one virtual stage (engine/planning/search.py), so the bubble is whatever the schedule leaves, for 1F1B the
(p-1)/(m+p-1) of Narayanan et al. 2021 Sec. 2.2.1, for interleaved about 1/v of it, for ZB-H1 (p-1)(F+B-W).
Past SIMULATED_GROUPS groups of pp micro-batches the steady state only repeats: each further micro-batch adds the
same time, so the makespan is extended along the line through the simulations at 2 pp and 3 pp micro-batches
(equal to the full simulation in every case tests/planning/test_plan_schedules.py and a wider sweep tried), which
keeps a search
over global
batches of thousands of micro-batches fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.config import Config
from engine.kinds.schedules import SCHEDULES
from engine.parallel.pp import schedule as sched
from engine.parallel.pp.actions import Op, max_in_flight, virtual_stage
from engine.planning import activations as acts
from engine.planning.balance import rank_ranges

# What the planner searches when the config leaves the schedule open: each schedule's ScheduleSpec.searched virtual
# stage counts (1F1B, interleaved with 2..4 virtual stages, ZB-H1 and ZB-V; GPipe declares none).
SEARCHED = tuple((name, v) for name, spec in SCHEDULES.items() for v in spec.searched)


def virtual_stages(cfg: Config) -> int:
    """Model chunks per rank: parallel.virtual_stages under interleaved, 2 in zbv's V, else 1 (ScheduleSpec)."""
    return SCHEDULES[cfg.parallel.schedule].per_rank(cfg.parallel.virtual_stages)


def head_stage(cfg: Config, pp: int) -> int:
    """The pipeline rank holding the final norm, LM head and loss: the last, or rank 0 in zbv's V."""
    return 0 if SCHEDULES[cfg.parallel.schedule].vshape else pp - 1


def one_embedding(cfg: Config, pp: int) -> bool:
    """A tied embedding and LM head are one tensor: at pp = 1, or on rank 0 of zbv's V."""
    return cfg.model.tie_embeddings and (pp == 1 or SCHEDULES[cfg.parallel.schedule].vshape)


def label(schedule: str, v: int) -> str:
    """Short name for tables: 1f1b, gpipe, il-v2 (interleaved, 2 virtual stages), zb-h1, zbv (ScheduleSpec.short)."""
    return SCHEDULES[schedule].short(v)


def rank_chunks(cfg: Config, pp: int, stage: int) -> list[tuple[int, int]]:
    """(virtual stage, layer count) of each model chunk rank ``stage`` holds, rank-local chunk c at index c.
    Interleaved: virtual stage g = c*pp + stage, zbv: g = stage and 2pp-1-stage, each its run of layers (even or
    parallel.pp_layers'; engine.planning.balance.rank_ranges, the split the stage module is cut by); otherwise one
    chunk, the stage's layers."""
    vshape = SCHEDULES[cfg.parallel.schedule].vshape
    ranges = rank_ranges(cfg, pp, stage)
    if len(ranges) == 1:
        return [(stage, len(ranges[0]))]
    return [(virtual_stage(pp, stage, c, vshape), len(r)) for c, r in enumerate(ranges)]


def chunk_bytes(cfg: Config, tp: int, pp: int, stage: int) -> list[float]:
    """Activations one micro-batch keeps alive on each of the rank's chunks, from its forward to its backward (to
    its W under zero bubble): the ledger of activations.py for the chunk's layers as a stage of pp*v."""
    chunks = pp * virtual_stages(cfg)
    return [acts.micro_batch_bytes(cfg, tp, chunks, g, n) for g, n in rank_chunks(cfg, pp, stage)]


def w_state_bytes(cfg: Config, tp: int, pp: int, stage: int) -> list[float]:
    """Zero bubble: what one micro-batch holds from its B to its W besides its activations, per chunk (see the
    module docstring); 0 for the other schedules."""
    if not SCHEDULES[cfg.parallel.schedule].split_w:
        return [0.0 for _ in rank_chunks(cfg, pp, stage)]
    m, t = cfg.model, cfg.train
    h, q, kvd, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    grads = 2 * h + (q + 2 * kvd + 2 * f) / tp  # output gradients of q k v o gate up down, per token
    # their inputs: qkv_proj's, o_proj's, gate_up_proj's, down_proj's; under sequence parallelism qkv_proj and
    # gate_up_proj queue only their (b, s/tp, h) shard, gathered again at W (engine/parallel/autograd/weight_grad.py)
    inputs = 2 * h / acts.sequence_share(cfg, tp) + (q + f) / tp
    tokens = t.micro_batch_size * t.seq_len
    return [tokens * acts.logit_bytes(cfg) * n * (grads + inputs) for _, n in rank_chunks(cfg, pp, stage)]


@dataclass
class InFlight:
    """A rank's activations over one step. ``count``: the most (micro-batch, chunk) pairs held at once (each 1/v
    of the stage under interleaving); ``peak``: the most bytes held; ``states``: each distinct state's bytes held
    and which of the rank's chunks have their weight gradients by then (from the chunk's first BWD, or its first B),
    for ``peak_with_grads``; ``w_state``: zero bubble's W state within ``peak``."""

    count: int
    peak: float
    states: tuple[tuple[float, tuple[bool, ...]], ...]
    w_state: float

    def peak_with_grads(self, chunk_grads: list[float]) -> float:
        """The most bytes held at once, each chunk's gradients (``chunk_grads[c]`` bytes) counted from that chunk's
        first backward on: under interleaving a rank's last chunk runs the first backward while its earlier chunks'
        activations are all still held and their gradients not yet made (1F1B: once past the warmup, the same as
        the peak if m is large enough; GPipe: one micro-batch fewer)."""
        return max(held + sum(g for g, made in zip(chunk_grads, begun) if made) for held, begun in self.states)


@lru_cache(maxsize=1024)
def actions(schedule: str, pp: int, micro_batches: int, stage: int, v: int) -> tuple:
    """engine.parallel.pp.schedule.build's action list, cached (the search plans many layouts per schedule)."""
    return tuple(sched.build(schedule, pp, micro_batches, stage, v))


@lru_cache(maxsize=None)
def held_states(schedule: str, pp: int, micro_batches: int, stage: int, v: int) -> tuple:
    """Walk the action list of rank ``stage`` once: the distinct states it passes through after each compute, as
    (activations held per chunk, W states held per chunk, whether each chunk's weight gradients exist yet). Bytes
    differ by chunk only, so the peak in bytes is the largest of these states priced (cached: one walk per schedule
    table)."""
    held, w_held, made = [0] * v, [0] * v, [False] * v
    states = {}
    for a in actions(schedule, pp, micro_batches, stage, v):
        if a.op is Op.FWD:
            held[a.chunk] += 1
        elif a.op is Op.BWD_INPUT:  # the graph is freed, the W state stays; the weights B does not split (the LM
            held[a.chunk] -= 1  # head, the norms) get their gradients here: the chunk's are counted from its first B
            w_held[a.chunk] += 1
            made[a.chunk] = True
        elif a.op in (Op.BWD, Op.BWD_WEIGHT):
            held[a.chunk] -= a.op is Op.BWD
            w_held[a.chunk] -= a.op is Op.BWD_WEIGHT
            made[a.chunk] = True
        else:
            continue
        states[(tuple(held), tuple(w_held), tuple(made))] = None  # first-seen order, no repeats
    return tuple(states)


def activations_in_flight(cfg: Config, tp: int, pp: int, micro_batches: int, stage: int) -> InFlight:
    """The schedule's action list of rank ``stage`` priced: what each compute leaves alive, added up."""
    key = (cfg.parallel.schedule, pp, micro_batches, stage, virtual_stages(cfg))
    held, w_held = chunk_bytes(cfg, tp, pp, stage), w_state_bytes(cfg, tp, pp, stage)
    peak = w_at_peak = 0.0
    priced = []
    for counts, w_counts, made in held_states(*key):
        w_bytes = sum(n * b for n, b in zip(w_counts, w_held))
        total = sum(n * b for n, b in zip(counts, held)) + w_bytes
        if total > peak:
            peak, w_at_peak = total, w_bytes
        priced.append((total, made))
    return InFlight(in_flight_count(*key), peak, tuple(priced), w_at_peak)


@lru_cache(maxsize=None)
def in_flight_count(schedule: str, pp: int, micro_batches: int, stage: int, v: int) -> int:
    """engine.parallel.pp.actions.max_in_flight of the rank's action list, cached as held_states is."""
    return max_in_flight(actions(schedule, pp, micro_batches, stage, v))


SIMULATED_GROUPS = 2


def makespan_and_idle(
    schedule: str, pp: int, micro_batches: int, v: int, fwd: float, bwd: float, bwd_input: float, bwd_weight: float
) -> tuple[float, list[float]]:
    """(makespan, idle time of each rank) of the simulated step (``timeline``), extended linearly in the
    micro-batches beyond SIMULATED_GROUPS * pp of them (module docstring)."""
    costs = (v, fwd, bwd, bwd_input, bwd_weight)
    m1 = SIMULATED_GROUPS * pp
    if micro_batches <= m1 + pp:
        t = timeline(schedule, pp, micro_batches, *costs)
        return t.makespan, list(t.idle)
    t1, t2 = timeline(schedule, pp, m1, *costs), timeline(schedule, pp, m1 + pp, *costs)
    k = (micro_batches - m1) / pp
    return t1.makespan + k * (t2.makespan - t1.makespan), [a + k * (b - a) for a, b in zip(t1.idle, t2.idle)]


@lru_cache(maxsize=4096)
def timeline(
    schedule: str, pp: int, micro_batches: int, v: int, fwd: float, bwd: float, bwd_input: float, bwd_weight: float
) -> sched.Timeline:
    """The simulated step (engine.parallel.pp.schedule.simulate, on the cached tables) with the costs of one
    micro-batch on one virtual stage: fwd, bwd (whole backward), and zero bubble's bwd_input (B) and bwd_weight
    (W). Cached: layouts that differ only in their dp mode share their costs."""
    tables = [actions(schedule, pp, micro_batches, s, v) for s in range(pp)]
    return sched.simulate_actions(tables, fwd, bwd, schedule, bwd_input, bwd_weight, SCHEDULES[schedule].vshape)
