"""The layouts the search of engine/planning/search.py tries (launch/plan.py): every (tp, pp, dp, cp, cp mode, ep,
sequence parallelism, dp mode and its variants, micro-batch size, activation checkpointing, schedule) that
engine/parallel/layout/checks.py accepts, as configs.
"""

from __future__ import annotations

import dataclasses

from engine.config import Config, ConfigError
from engine.kinds.cp_modes import CP_MODES
from engine.kinds.dp_modes import MODES as DP_MODE_SPECS
from engine.kinds.offload import OFFLOADS
from engine.kinds.recompute import RECOMPUTE
from engine.kinds.schedules import SCHEDULES
from engine.parallel.layout.checks import Layout, check_supported, resolve_layout
from engine.planning.planner import planner_model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dp_modes(offload: str, dp: int) -> list[tuple[str, int, str, str, str]]:
    """The (dp mode, zero stage, reshard, offload, fsdp gradient accumulation) tried at ``dp`` ranks: each registered
    mode with a planner model, its variants (engine/planning/dp.py) with parallel.offload ``offload`` ("any": every
    offload but none). Offload is tried only where no layout fits without it (or the config asks for it): on a GPU it
    trades host copies and a host Adam step for device memory. At dp = 1 only modes that do not shard (sharding over
    one rank changes nothing)."""
    out = []
    tried = [name for name, s in OFFLOADS.items() if s.offloads] if offload == "any" else [offload]
    for name, spec in DP_MODE_SPECS.items():
        model = planner_model(name) if spec.planner else None
        if model is None or (dp == 1 and not any(OFFLOADS[w].offloads for w in tried) and model.shards):
            continue
        for wanted in tried:
            out += [(name, *v) for v in model.variants(wanted)]
    return out


def _axes(cfg: Config, world_size: int):
    """(tp, pp, cp, cp mode) to try: cp a power of two (each rank takes 2 of 2 cp chunks, so seq_len must split),
    both cp modes where cp > 1 (all_to_all only where the heads divide: resolve_layout refuses the rest), the
    config's cp_mode at cp = 1 where no mode applies."""
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            for cp in _divisors(world_size // (tp * pp)):
                if cp & (cp - 1) or cfg.train.seq_len % (2 * cp):
                    continue
                for mode in CP_MODES if cp > 1 else (cfg.parallel.cp_mode,):
                    yield tp, pp, cp, mode


def _sp(tp: int) -> tuple[bool, ...]:
    """parallel.sequence_parallel values to try at ``tp``: both where it applies (tp > 1; resolve_layout refuses a
    seq_len that tp does not divide), off at tp = 1. Its tp collectives move the bytes of the all-reduces it replaces
    (reduce-scatter + all-gather) and, backward, re-gather each column linear's input (engine/planning/tp.py): it
    divides the memory and the pipeline transfers by tp for a little more tp time."""
    return (False, True) if tp > 1 else (False,)


def _ep_sizes(cfg: Config, dp: int) -> list[int]:
    """Expert-parallel sizes to try at ``dp`` data-parallel ranks (dp x cp: the ranks that hold the same dense
    weights): those dividing both it and model.num_experts (resolve_layout refuses what this build cannot run);
    1 for a dense model."""
    return [ep for ep in _divisors(dp) if cfg.model.num_experts % ep == 0] if cfg.model.num_experts else [1]


def _dp_variants(offload: str, ranks: int, micro_batches: int, schedule: str) -> list[dict]:
    """dp_modes' variants at ``ranks`` (dp x cp) as parallel fields, leaving out fsdp's unsharded accumulation where
    it is the same as sharded: one micro-batch a step, or a schedule that accumulates unsharded anyway (zero bubble,
    zbv: W adds the weight gradients outside autograd)."""
    return [
        dict(dp_mode=mode, zero_stage=stage, reshard_after_forward=reshard, offload=off, fsdp_grad_accumulation=acc)
        for mode, stage, reshard, off, acc in dp_modes(offload, ranks)
        if acc == "sharded" or (micro_batches > 1 and not SCHEDULES[schedule].split_w)
    ]


def layouts(
    cfg: Config,
    world_size: int,
    schedules: tuple[tuple[str, int], ...] | None = None,
    refused: list[tuple[Layout, str]] | None = None,
    offload: str | None = None,
    keep=None,
):
    """Every valid (tp, pp, dp, cp, cp mode, ep, sp, dp mode, micro-batch size, activation checkpointing, schedule) of
    ``cfg`` on ``world_size`` ranks, as configs. ``schedules``: (schedule, virtual stages) pairs to try (default: the
    config's; engine.planning.schedules.SEARCHED is every one), the first alone at pp = 1 where no pipeline runs.
    Validity is engine.parallel.layout.checks.resolve_layout's ((tp, pp, dp), message of each refusal go to
    ``refused``); at dp = 1 only ddp (sharding over one rank changes nothing). ``offload``: dp_modes' (default the
    config's parallel.offload). ``keep``: a predicate; only the configs it accepts are checked and yielded."""
    gbs = cfg.train.global_batch_size
    schedules = schedules or ((cfg.parallel.schedule, cfg.parallel.virtual_stages),)
    for tp, pp, cp, cp_mode in _axes(cfg, world_size):
        dp = world_size // (tp * pp * cp)
        if gbs % dp:
            continue
        # the sections are built once per combination of their own fields (with_layout's result, shared: configs
        # are never changed in place), not once per layout: the search at 16,384 ranks builds ~10^6 of them
        trains = {
            (mbs, ac): dataclasses.replace(cfg.train, micro_batch_size=mbs, activation_checkpointing=ac)
            for mbs in _divisors(gbs // dp)
            for ac in RECOMPUTE
        }
        for schedule, v in schedules[:1] if pp == 1 else schedules:
            pp_layers = searched_split(cfg, pp, schedule, v)
            built: dict = {}  # parallel sections of this (tp, pp, cp, schedule), one per (sp, ep, dp mode), not per mbs
            for sp, mbs, ep in (
                (sp, mbs, ep) for sp in _sp(tp) for mbs in _divisors(gbs // dp) for ep in _ep_sizes(cfg, dp * cp)
            ):
                for variant in _dp_variants(offload or cfg.parallel.offload, dp * cp, gbs // dp // mbs, schedule):
                    key = (sp, ep, *variant.values())
                    if key not in built:
                        built[key] = dataclasses.replace(
                            cfg.parallel,
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            cp=cp,
                            cp_mode=cp_mode,
                            ep=ep,
                            **variant,
                            pp_layers=pp_layers,
                            sequence_parallel=sp,
                            # the config's overlap where it applies (sp, a schedule without deferred W)
                            tp_comm_overlap=cfg.parallel.tp_comm_overlap and sp and not SCHEDULES[schedule].split_w,
                            schedule=schedule,
                            virtual_stages=v,
                        )
                    for ac in RECOMPUTE:
                        c = dataclasses.replace(cfg, parallel=built[key], train=trains[mbs, ac])
                        if keep is not None and not keep(c):
                            continue
                        layout = _resolved(c, Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep), world_size, refused)
                        if layout is not None:
                            yield c, layout


def searched_split(cfg: Config, pp: int, schedule: str, v: int) -> list[int] | str:
    """parallel.pp_layers of a searched layout: the config's where its counts fit (the same pp and as many counts as
    the layout has stages or virtual stages; "auto" is a rule, not counts: it balances every one), else the even
    split; where that cannot cut a chunked schedule's pp*v equal chunks but each can have a layer, the balanced one
    (auto: Llama 3 405B's 126 layers on pp 16 x v 2, engine/planning/balance.py)."""
    given, runs = cfg.parallel.pp_layers, pp * SCHEDULES[schedule].per_rank(v) if pp > 1 else 1
    if given == "auto" or (given and pp == cfg.parallel.pp and len(given) == runs):
        return given
    return "auto" if pp < runs <= cfg.model.num_layers and cfg.model.num_layers % runs else []


def _resolved(cfg: Config, asked: Layout, world_size: int, refused: list | None) -> Layout | None:
    """resolve_layout's layout of ``cfg``, or None when refused ((asked, message) then goes to ``refused``)."""
    try:
        # the dp-mode refusals first: resolve_layout's schedule check builds a table
        check_supported(cfg, asked)
        return resolve_layout(cfg, world_size)  # refuses unsupported combinations too
    except ConfigError as e:
        if refused is not None:
            refused.append((asked, str(e)))
        return None
