"""The parity matrix: every layout the engine is asked to support within 8 ranks, as data (no processes, no torch).

One ``Combo`` is a point of the product of these factors (``FACTORS``):

    tp, pp, dp in {1, 2, 4} with tp * pp * dp <= 8
    dp_mode: ddp | fsdp-reshard | fsdp-keep | zero1 | zero2 | zero3, and with host offload (parallel.offload):
             zero2-offload (optimizer) | zero3-offload | fsdp-offload (optimizer_and_params; fsdp resharding)
    schedule: 1f1b | gpipe | interleaved (2 virtual stages) | zero_bubble | zbv (ZB-V, 2 chunks per rank in a V)
              (only with pp > 1; "-" at pp = 1, where there is no schedule); interleaved and zbv at pp = 4 run 8
              layers (4 cannot split into 8 chunks), against an 8-layer single process
    dtype: fp32 | bf16;  tied / untied embeddings;  activation checkpointing off / on
    clip: off (train.grad_clip 0) | on (a threshold below the gradient norm, so every step is clipped)
    sp: sequence parallelism off | on (only with tp > 1, where it applies; off at tp = 1)
    cp in {1, 2, 4} (tp * pp * dp * cp <= 8), cp_mode: ring | all_to_all (only with cp > 1; "-" at cp = 1)
    model: dense | moe (runner.BASE as a Mixtral of 4 experts, top 2, aux and z losses on: MOE_ARGS; under tp
           the experts are tp-sharded, engine/parallel/tp/moe.py)
    ep: 1 | 2 | 4 (parallel.ep, expert parallelism: moe only, ep dividing dp x cp, the ranks it is carved from;
        ep > 1 with ddp and fsdp, EP_DP_MODE)

``refusal(combo)`` states, independently of the engine's own checks, which combinations the engine must refuse and
with which words; the tests check that the engine gives exactly that error, so an accidental refusal or an
accidental acceptance both fail. ``full_matrix()`` is every combination with clipping off (clipping off is what
makes a gradient that is off by a constant factor visible: clipping followed by Adam hides it);
``covering_subset()`` is the CI subset: every pair of factor values that occurs in some supported combination,
clipping on included, appears in at least one chosen combination (greedy pairwise covering, cheapest first),
with the offload modes left out of the covering and run as ``offload_slice()`` (on a CPU offload is the same
arithmetic in the same place, so a few layouts per mode show it is wired in; ``--full`` runs them all).

    python -m tests.parity --list          # the matrix and the CI subset, without running anything
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass

SIZES = (1, 2, 4)
DP_MODES = ("ddp", "fsdp-reshard", "fsdp-keep", "zero1", "zero2", "zero3")
OFFLOAD_MODES = ("zero2-offload", "zero3-offload", "fsdp-offload")  # parallel.offload: optimizer, +params, +params
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero_bubble", "zbv")
CP_MODES = ("ring", "all_to_all")
FACTORS = ("tp", "pp", "dp", "dp_mode", "schedule", "dtype", "tied", "ac", "clip", "sp", "cp", "cp_mode", "model", "ep")
MODELS = ("dense", "moe")
# The MoE model: BASE's shape with each MLP 4 Mixtral experts (top 2), the loss with its aux and z terms.
MOE_ARGS = [
    "--model.family",
    "mixtral",
    "--model.num_experts",
    "4",
    "--model.experts_per_token",
    "2",
    "--train.moe_aux_loss_coef",
    "0.01",
    "--train.moe_z_loss_coef",
    "0.001",
]
MAX_WORLD = 8


@dataclass(frozen=True, order=True)
class Combo:
    tp: int
    pp: int
    dp: int
    dp_mode: str
    schedule: str  # "-" when pp == 1
    dtype: str
    tied: bool
    ac: bool
    clip: bool
    sp: bool = False  # parallel.sequence_parallel (tp > 1 only)
    layers: int = 4  # model.num_layers: runner.BASE's 4, or 8 where interleaving needs them (not a factor)
    cp: int = 1  # parallel.cp (context parallelism)
    cp_mode: str = "-"  # parallel.cp_mode when cp > 1
    model: str = "dense"  # dense | moe (MOE_ARGS)
    ep: int = 1  # parallel.ep (moe only; divides dp x cp)
    pp_layers: tuple[int, ...] = ()  # parallel.pp_layers: per stage, or per virtual stage (uneven_slice); () even

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def name(self) -> str:
        return (
            f"tp{self.tp}-pp{self.pp}-dp{self.dp}-{self.dp_mode}"
            + (f"-{self.schedule}" if self.pp > 1 else "")
            + f"-{self.dtype}"
            + ("-tied" if self.tied else "")
            + ("-ac" if self.ac else "")
            + ("-clip" if self.clip else "")
            + ("-sp" if self.sp else "")
            + (f"-L{self.layers}" if self.layers != 4 else "")
            + (f"-cp{self.cp}-{self.cp_mode}" if self.cp > 1 else "")
            + ("-moe" if self.model == "moe" else "")
            + (f"-ep{self.ep}" if self.ep > 1 else "")
            + (f"-uneven{'.'.join(map(str, self.pp_layers))}" if self.pp_layers else "")
        )

    def argv(self) -> list[str]:
        """The engine's command-line overrides for this combination (on top of runner.BASE)."""
        mode, _, option = self.dp_mode.partition("-")
        args = [
            "--parallel.tp",
            str(self.tp),
            "--parallel.pp",
            str(self.pp),
            "--parallel.dp",
            str(self.dp),
            "--train.dtype",
            self.dtype,
            "--model.tie_embeddings",
            str(self.tied).lower(),
            "--train.activation_checkpointing",
            str(self.ac).lower(),
            "--parallel.sequence_parallel",
            str(self.sp).lower(),
        ]
        if self.pp > 1:
            args += ["--parallel.schedule", self.schedule]
        if self.schedule == "interleaved":
            args += ["--parallel.virtual_stages", "2"]
        if self.layers != 4:
            args += ["--model.num_layers", str(self.layers)]
        if self.cp > 1:
            args += ["--parallel.cp", str(self.cp), "--parallel.cp_mode", self.cp_mode]
        if mode == "fsdp":
            args += [
                "--parallel.dp_mode",
                "fsdp",
                "--parallel.reshard_after_forward",
                "false" if option == "keep" else "true",
            ]
        elif mode.startswith("zero"):
            args += ["--parallel.dp_mode", "zero", "--parallel.zero_stage", mode[-1]]
        else:
            args += ["--parallel.dp_mode", "ddp"]
        if option == "offload":
            args += ["--parallel.offload", "optimizer" if mode == "zero2" else "optimizer_and_params"]
        if self.ep > 1:
            args += ["--parallel.ep", str(self.ep)]
        if self.pp_layers:
            args += ["--parallel.pp_layers", f"[{','.join(map(str, self.pp_layers))}]"]
        return args + (MOE_ARGS if self.model == "moe" else [])

    def values(self) -> dict:
        """Factor -> value, leaving out a factor that does not matter for covering: the schedule at pp = 1, sequence
        parallelism at tp = 1 (always off there), and the dp mode at dp = 1 (the wrapper runs, but nothing is reduced
        or sharded), so that pairs with a dp mode are
        covered where that mode really works across ranks."""
        v = asdict(self)
        del v["layers"], v["pp_layers"]  # not factors: uneven_slice declares its rows
        if self.pp == 1:
            del v["schedule"]
        if self.tp == 1:
            del v["sp"]
        if self.dp == 1:
            del v["dp_mode"]
        # cp as on/off: its pairs with every other factor's values at cp 2 or 4 (the cheaper, as the greedy picks),
        # and cp 4 itself once per cp_mode (_pairs): cp 2 and 4 differ only in layout arithmetic, which cp 4 with
        # each mode exercises, and pairing each size with every dp mode would add a third to the CI's time.
        v["cp"] = self.cp > 1
        if self.cp == 1:
            del v["cp_mode"]
        return v


def layouts() -> list[tuple[int, int, int, int]]:
    """(tp, pp, dp, cp) within MAX_WORLD ranks."""
    return [
        (tp, pp, dp, cp)
        for tp, pp, dp, cp in itertools.product(SIZES, SIZES, SIZES, SIZES)
        if tp * pp * dp * cp <= MAX_WORLD
    ]


def all_combos(clip: tuple[bool, ...] = (False, True)) -> list[Combo]:
    out = []
    for (tp, pp, dp, cp), mode, dtype, tied, ac, c, model in itertools.product(
        layouts(), DP_MODES + OFFLOAD_MODES, ("fp32", "bf16"), (False, True), (False, True), clip, MODELS
    ):
        for schedule, sp, cp_mode in itertools.product(
            SCHEDULES if pp > 1 else ("-",), (False, True) if tp > 1 else (False,), CP_MODES if cp > 1 else ("-",)
        ):
            layers = 8 if schedule in ("interleaved", "zbv") and pp == 4 else 4
            for ep in (e for e in SIZES if dp * cp % e == 0) if model == "moe" else (1,):
                out.append(Combo(tp, pp, dp, mode, schedule, dtype, tied, ac, c, sp, layers, cp, cp_mode, model, ep))
    return sorted(out)


# Refusals, in the order the engine checks them. Each is (reason shown in docs/proofs.md, words the error must hold).
TIED_ZERO_PP = (
    "ZeRO-2/3, or bf16 ZeRO-1, with tied embeddings across pipeline stages: the two copies' gradients "
    "must be summed before DeepSpeed reduces them, which only fp32 ZeRO-1 allows",
    "model.tie_embeddings=true is not supported",
)
ZERO3_PP = (
    "ZeRO-3 with pp > 1: DeepSpeed compares module traces across all ranks and hangs under pipeline stages",
    "zero_stage=3 and parallel.pp>1 is not supported",
)


ZERO2_OFFLOAD_INTERLEAVED = (
    "fp32 ZeRO-2 with the optimizer offloaded under interleaved: DeepSpeed adds each "
    "gradient to its host accumulator from the step's second backward on, assuming every "
    "parameter had one in the first (a later chunk's first gradient adds the last step's)",
    "the optimizer offloaded and train.dtype=fp32 is not supported",
)
ZERO_ZB_HOOKS = (
    "ZeRO-2, or bf16 ZeRO-1, under zero_bubble: DeepSpeed reduces (ZeRO-2) or moves into its fp32 "
    "accumulator (bf16 ZeRO-1) each gradient in hooks autograd fires, and W adds the linears' weight "
    "gradients outside autograd",
    "schedule=zero_bubble with parallel.dp_mode=zero",
)
ZBV_ZERO = (
    "ZeRO under zbv: it does not declare zbv's sync point, each of its 2 chunks' last W",
    "is not supported (the gradient sync would have to follow",
)
ZBV_FSDP_TIED = (
    "FSDP under zbv with a tied embedding: rank 0's two chunks are two FSDP root units holding the "
    "one tied weight (measured wrong)",
    "and model.tie_embeddings=true is not supported: rank 0's",
)


# runner.BASE has 8 heads and 4 kv heads: all_to_all gives each cp x tp rank whole heads of both.
CP_HEADS = (
    "cp_mode all_to_all with cp x tp not dividing the kv heads (runner.BASE: 4): each rank of the "
    "all-to-all takes whole heads",
    "divisible by cp * tp",
)


EP_DP_MODE = (
    "ep > 1 with zero: DeepSpeed's flat buffers partition every parameter over the whole dp group, while "
    "the experts differ between ep ranks",
    "is not supported (DeepSpeed's flat buffers partition every",
)


def refusal(c: Combo) -> tuple[str, str] | None:
    """(reason, words of the error) if the engine must refuse ``c``, else None. FSDP (every variant) runs under
    every schedule (under zbv untied), ZeRO-1/2 under interleaved (but fp32 ZeRO-2 offload), fp32 ZeRO-1 under
    zero_bubble, and none under zbv."""
    if c.cp > 1 and c.cp_mode == "all_to_all" and 4 % (c.cp * c.tp):
        return CP_HEADS
    if c.ep > 1 and c.dp_mode.startswith("zero"):
        return EP_DP_MODE
    if c.schedule == "zbv" and c.dp_mode.startswith("zero"):
        return ZBV_ZERO
    if c.schedule == "zbv" and c.dp_mode.startswith("fsdp") and c.tied:
        return ZBV_FSDP_TIED
    if c.dp_mode.startswith("zero") and c.pp > 1:
        if c.tied and (c.dp_mode != "zero1" or c.dtype != "fp32"):
            return TIED_ZERO_PP
        if c.dp_mode.startswith("zero3"):
            return ZERO3_PP
        if c.schedule == "interleaved" and c.dp_mode == "zero2-offload" and c.dtype == "fp32":
            return ZERO2_OFFLOAD_INTERLEAVED
        if c.schedule == "zero_bubble" and (c.dp_mode != "zero1" or c.dtype != "fp32"):
            return ZERO_ZB_HOOKS
    return None


def full_matrix() -> list[Combo]:
    """Every supported combination, clipping off, and the uneven pipeline splits."""
    return [c for c in all_combos(clip=(False,)) if refusal(c) is None] + uneven_slice()


def refused() -> list[Combo]:
    """Every refused combination (clipping does not change a refusal, so it is left off)."""
    return [c for c in all_combos(clip=(False,)) if refusal(c) is not None]


def cost(c: Combo) -> float:
    """Rough CPU seconds of one parity run: ranks share 2 cores; bf16 matmuls are slow on CPUs; DeepSpeed's
    set-up is slow."""
    return (
        c.world
        * (1.6 if c.dtype == "bf16" else 1.0)
        * (1.4 if c.dp_mode.startswith("zero") else 1.0)
        * (1.2 if c.ac else 1.0)
    )


@functools.lru_cache(maxsize=None)
def _pairs(c: Combo) -> frozenset:
    """The pairs of factor values ``c`` covers, plus one known three-way interaction: a tied embedding split over
    pipeline stages under each dp mode (the last stage's copy is synced and left out of the norm by every mode
    its own way; a bug there passed the pairwise subset once, caught only by a resume test)."""
    items = sorted(c.values().items())
    pairs = {(a, b) for a, b in itertools.combinations(items, 2)}
    if c.tied and c.pp > 1:
        pairs.add((("tied_across_stages", True), ("dp_mode", c.dp_mode)))
    if c.cp > 1:
        pairs.add((("cp_mode", c.cp_mode), ("cp_size", c.cp)))
    return frozenset(pairs)


def covering_subset() -> list[Combo]:
    """Greedy pairwise covering of the supported combinations (clip off and on): repeatedly take the combination
    that covers the most not-yet-covered pairs of factor values per unit of cost (ties: the smaller combo first,
    so the choice is deterministic); then drop, costliest first, each chosen one whose pairs the others cover (the
    greedy's early picks are often covered by its later ones: 97 combinations, cost 614 -> 84, 567)."""
    pool = [c for c in all_combos() if refusal(c) is None and c.dp_mode not in OFFLOAD_MODES]
    uncovered = set().union(*(_pairs(c) for c in pool))
    chosen = []
    while uncovered:
        best = max(pool, key=lambda c: (len(_pairs(c) & uncovered) / cost(c), [-x for x in _key(c)]))
        chosen.append(best)
        uncovered -= _pairs(best)
    for c in sorted(chosen, key=lambda c: (-cost(c), _key(c))):
        if _pairs(c) <= set().union(*(_pairs(x) for x in chosen if x != c)):
            chosen.remove(c)
    return sorted(chosen)


def ci_combos() -> list[Combo]:
    """What CI runs: the pairwise covering subset, the offload slice and the uneven splits' CI rows."""
    return covering_subset() + offload_slice() + [c for c in uneven_slice() if c in UNEVEN_CI]


def _uneven(pp, dp, mode, schedule, counts, tied=False, dtype="fp32", tp=1) -> Combo:
    layers = sum(counts)
    return Combo(tp, pp, dp, mode, schedule, dtype, tied, False, False, layers=layers, pp_layers=tuple(counts))


def uneven_slice() -> list[Combo]:
    """parallel.pp_layers: stages (1f1b, gpipe, zero_bubble: one count per stage) and virtual stages (interleaved
    at v 2, zbv: one count per virtual stage, in virtual-stage order) holding different numbers of layers, every
    schedule at pp 2 alone and under the dp modes it runs with, against the one process of as many layers. The
    chunked rows run 6 layers split so that the ranks differ too ([1, 1, 3, 1]: interleaved rank 0 holds virtual
    stages 0 and 2, 4 layers, rank 1 2; zbv's V rank 0 holds 0 and 3, 2 layers, rank 1 4), and Meta's shape, fewer
    on the first and the last ([1, 2, 2, 1]), with a tied embedding."""
    return sorted(
        [
            _uneven(2, 1, "ddp", "1f1b", (3, 1)),
            _uneven(2, 1, "ddp", "gpipe", (1, 3)),
            _uneven(2, 1, "ddp", "zero_bubble", (3, 1)),
            _uneven(2, 1, "ddp", "interleaved", (1, 1, 3, 1)),
            _uneven(2, 1, "ddp", "zbv", (1, 1, 3, 1)),
            _uneven(2, 1, "ddp", "interleaved", (1, 2, 2, 1), tied=True),
            _uneven(2, 1, "ddp", "zbv", (1, 2, 2, 1), tied=True),
            _uneven(2, 2, "ddp", "interleaved", (1, 1, 3, 1)),
            _uneven(2, 2, "fsdp-reshard", "interleaved", (1, 1, 3, 1)),
            _uneven(2, 2, "fsdp-keep", "zbv", (1, 1, 3, 1)),
            _uneven(2, 2, "zero1", "interleaved", (1, 1, 3, 1)),
            _uneven(2, 2, "zero2", "interleaved", (3, 1, 1, 1)),
            _uneven(2, 2, "fsdp-reshard", "zero_bubble", (1, 3)),
            _uneven(2, 2, "zero1", "gpipe", (3, 1)),
            _uneven(2, 1, "ddp", "interleaved", (1, 1, 3, 1), tp=2),
            _uneven(2, 1, "ddp", "zbv", (1, 1, 3, 1), dtype="bf16"),
        ]
    )


def held_layers(c: Combo) -> list[set[int]]:
    """The decoder layers each pipeline rank must hold under ``c.pp_layers``, stated here apart from the engine's
    split: virtual stage g holds the g-th run of counts[g] layers; it sits on rank g (one chunk per rank), g mod pp
    (interleaved), or g and 2pp-1-g on rank g's V (zbv)."""
    counts, pp = c.pp_layers, c.pp
    starts = list(itertools.accumulate(counts, initial=0))
    held: list[set[int]] = [set() for _ in range(pp)]
    for g, n in enumerate(counts):
        rank = g if len(counts) == pp else g % pp if c.schedule == "interleaved" else min(g, 2 * pp - 1 - g)
        held[rank] |= set(range(starts[g], starts[g] + n))
    return held


# The uneven rows CI runs (chosen by cost: world 2, one per chunked placement; the rest run with --full).
UNEVEN_CI = (
    _uneven(2, 1, "ddp", "interleaved", (1, 1, 3, 1)),
    _uneven(2, 1, "ddp", "zbv", (1, 1, 3, 1)),
)


def offload_slice() -> list[Combo]:
    """The offload modes' CI slice: each mode across dp 2 alone, with tp, with pp (1F1B, tied embeddings where the
    mode allows them), bf16, clipping and activation checkpointing spread over them."""
    return sorted(
        [
            Combo(1, 1, 2, "zero2-offload", "-", "fp32", False, False, True),
            Combo(2, 1, 2, "zero2-offload", "-", "bf16", False, True, False),
            Combo(1, 2, 2, "zero2-offload", "1f1b", "fp32", False, False, False),
            Combo(1, 1, 2, "zero3-offload", "-", "fp32", True, True, True),
            Combo(2, 1, 2, "zero3-offload", "-", "fp32", False, False, False, True),
            Combo(1, 1, 2, "fsdp-offload", "-", "fp32", False, False, True),
            Combo(1, 2, 2, "fsdp-offload", "1f1b", "fp32", True, False, False),
            Combo(2, 1, 2, "fsdp-offload", "-", "bf16", False, True, False),
        ]
    )


def _key(c: Combo) -> tuple:
    return (
        c.world,
        c.tp,
        c.pp,
        c.dp,
        (DP_MODES + OFFLOAD_MODES).index(c.dp_mode),
        SCHEDULES.index(c.schedule) if c.pp > 1 else 0,
        c.dtype == "bf16",
        c.tied,
        c.ac,
        c.clip,
        c.sp,
        c.layers,
        c.cp,
        CP_MODES.index(c.cp_mode) if c.cp > 1 else -1,
        MODELS.index(c.model),
        c.ep,
    )


@dataclass(frozen=True)
class Resume:
    """Train ``save_at`` steps at ``source``, save, resume at ``target`` and train to the end; the whole curve is
    compared with the uninterrupted single-process run."""

    source: Combo
    target: Combo

    @property
    def name(self) -> str:
        return f"{self.source.name}->{self.target.name}"


def _combo(
    tp=1,
    pp=1,
    dp=1,
    mode="ddp",
    schedule=None,
    dtype="fp32",
    tied=False,
    ac=False,
    clip=False,
    model="dense",
    pp_layers=(),
    layers=4,
) -> Combo:
    schedule = schedule or ("1f1b" if pp > 1 else "-")
    return Combo(tp, pp, dp, mode, schedule, dtype, tied, ac, clip, layers=layers, model=model, pp_layers=pp_layers)


def resume_scenarios() -> list[Resume]:
    """One source per dp_mode family (ddp, fsdp, zero 1/2/3), each resumed at another layout and mode; gpipe, pp4,
    tp4, bf16 and tied embeddings appear on one side or the other; most run with clipping off. Two more move
    between the interleaved (v=2) and zero-bubble schedules, one from zbv (tied) to 1f1b, and one moves the MoE model
    from zero1 x pp 2 to fsdp."""
    return [
        Resume(_combo(dp=2, mode="ddp", pp=2, schedule="gpipe"), _combo(tp=4, mode="fsdp-reshard")),
        Resume(_combo(pp=4, mode="ddp", tied=True, clip=True), _combo(tp=2, dp=2, mode="zero1", tied=True)),
        Resume(_combo(tp=2, dp=2, mode="fsdp-keep", pp=2), _combo(pp=4, dp=2, mode="ddp", schedule="gpipe")),
        Resume(_combo(dp=4, mode="zero1", pp=2), _combo(tp=2, dp=2, mode="zero3")),
        Resume(_combo(tp=2, dp=2, mode="zero2", pp=2, clip=True), _combo(dp=2, mode="fsdp-reshard", pp=2)),
        Resume(_combo(tp=4, dp=2, mode="zero3"), _combo(pp=4, mode="ddp")),
        Resume(_combo(dp=2, mode="zero1", dtype="bf16"), _combo(tp=2, dp=2, mode="fsdp-keep", dtype="bf16")),
        Resume(_combo(tp=2, mode="fsdp-reshard", dtype="bf16", dp=2), _combo(pp=2, dp=2, mode="zero2", dtype="bf16")),
        # Checkpoints name layers globally, so the schedule and its virtual stages change freely on resume.
        Resume(_combo(pp=2, dp=2, schedule="interleaved", tied=True), _combo(pp=4, schedule="zero_bubble")),
        Resume(_combo(pp=4, schedule="zero_bubble"), _combo(pp=2, tp=2, schedule="interleaved")),
        # The MoE model: stacked expert weights and their Adam moments, stored per expert, across pp and dp modes.
        Resume(_combo(pp=2, dp=2, mode="zero1", model="moe"), _combo(dp=4, mode="fsdp-reshard", model="moe")),
        # zbv's V: a tied embedding is one parameter on rank 0, a copy on the last stage elsewhere; uneven splits
        # on both sides (parallel.pp_layers per virtual stage, then per stage): layers move between ranks by name
        Resume(
            _combo(pp=2, dp=2, schedule="zbv", tied=True, layers=6, pp_layers=(1, 3, 1, 1)),
            _combo(pp=2, dp=2, schedule="1f1b", tied=True, layers=6, pp_layers=(2, 4)),
        ),
    ]
