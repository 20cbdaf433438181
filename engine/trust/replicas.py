"""Replica agreement (train.check_replicas_every): the ranks that must hold identical weights compare a digest of each
local tensor, so one device computing wrong numbers (silent data corruption) stops the run before its weights reach a
checkpoint.

Which ranks must agree is the dp mode's declaration (engine/kinds/dp_modes.py ``identical_over``): under ddp every
parameter over the data group (dp x cp; the expert-parallel ones over expert-dp), under every mode the parameters
each tp rank holds whole (norms) over tp. A digest is two numbers per tensor, read in place (no copy): the int64 sum
of its bit pattern (exact and independent of the summation order, so any single flipped bit changes it) and the
float64 sum of its values. One all-gather of the (tensors, 2) digests per group, one all-reduce of the verdict over
the world (so every rank stops together, whichever group saw it), and only on a mismatch one exchange of the text.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.kinds import dp_modes
from engine.model.shards import local, tp_dim
from engine.parallel.ep import expert_parameters

EXIT_STATUS = 4  # launch/pretrain.py: replicas disagree (README "Replica agreement")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDisagree(RuntimeError):
    """Ranks that must hold identical weights do not (the same text on every rank)."""


def digest(t: torch.Tensor) -> torch.Tensor:
    """(2,) int64: the sum of the tensor's bit pattern and its float64 value sum (bits reinterpreted), in place."""
    x = local(t.detach())
    if not x.is_contiguous():
        x = x.contiguous()
    bits = x.view(_BITS[x.element_size()]).sum(dtype=torch.int64)
    values = x.sum(dtype=torch.float64) if x.is_floating_point() else x.sum(dtype=torch.int64).double()
    return torch.stack([bits, values.view(torch.int64)])


def replicated_over_tp(model: torch.nn.Module) -> list[str]:
    """Names of the parameters every tp rank holds whole (tp_dim None): the norms (all of them at tp 1)."""
    modules = dict(model.named_modules())
    names = []
    for name, _ in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        if tp_dim(modules[owner], attr) is None:
            names.append(name)
    return names


class ReplicaCheck:
    """One per Trainer: ``maybe_check(step)`` after each optimizer step (before that step's save)."""

    def __init__(self, cfg, ctx, model: torch.nn.Module):
        self.every, self.ctx, self.model = cfg.train.check_replicas_every, ctx, model
        # besides every N-th step, the steps whose checkpoint is due (periodic, last), so none is saved unchecked
        self.save_every = cfg.checkpoint.every if cfg.checkpoint.dir else 0
        self.last_step = cfg.train.steps
        params = dict(model.named_parameters())
        experts = {name for name, _ in expert_parameters(model)}
        self.plan: list[tuple[str, object, list[str]]] = []  # (group name, group, tensor names), the same order
        for name in dp_modes.spec(cfg).identical_over if self.every else ():
            if name == "tp":
                names = replicated_over_tp(model)
            elif ctx.size("ep") > 1:
                names = [n for n in params if n not in experts]
            else:
                names = list(params)
            self.plan.append((name, ctx.group(name), names))
            if name == "dp_cp" and experts and ctx.size("ep") > 1:
                self.plan.append(("edp", ctx.group("edp"), sorted(experts)))
        self.params = params

    def maybe_check(self, step: int, before_raising=lambda: None) -> None:
        """Compare at every train.check_replicas_every-th step and before a periodic or final save; raise
        ReplicasDisagree on every rank on a mismatch, after ``before_raising`` (the trainer's: an async save of an
        earlier, clean step commits). A save on a stop signal between checks is not checked."""
        saving = (self.save_every and step % self.save_every == 0) or step == self.last_step
        if not self.every or (step % self.every and not saving):
            return
        found = []
        for name, group, names in self.plan:
            if group is None or dist.get_world_size(group) < 2 or not names:
                continue
            found += self.compare(name, group, names, step)
        try:
            self.agree(found, step)
        except ReplicasDisagree:
            before_raising()
            raise

    def compare(self, name: str, group, names: list[str], step: int) -> list[str]:
        """All-gather this group's digests; one line per tensor on which some rank differs from the others."""
        mine = torch.stack([digest(self.params[n]) for n in names])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        table = torch.stack(everyone).cpu()  # (ranks, tensors, 2)
        lines = []
        for i in (table != table[0]).any(dim=2).any(dim=0).nonzero().flatten().tolist():
            lines.append(describe(names[i], [tuple(row[i].tolist()) for row in table], ranks, name))
        return lines

    def agree(self, found: list[str], step: int) -> None:
        """Every rank learns whether any group disagreed (one all-reduce) and, if so, what (one exchange)."""
        flag = torch.tensor([1 if found else 0], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        texts: list = [None] * dist.get_world_size()
        dist.all_gather_object(texts, found)
        lines = list(dict.fromkeys(line for part in texts for line in part))
        more = f" (and {len(lines) - 3} more tensors)" if len(lines) > 3 else ""
        raise ReplicasDisagree(f"replicas disagree at step {step}: " + "; ".join(lines[:3]) + more)


def describe(tensor: str, digests: list[tuple], ranks: list[int], group: str) -> str:
    """'<tensor> on rank 3 differs from ranks 0-2 (dp_cp group of ranks 0-3)'; with no majority (two ranks, or a
    tie) every rank is named: which copy is wrong cannot be told."""
    counts = {d: digests.count(d) for d in digests}
    top = max(counts.values())
    members = f"({group} group of ranks {span(ranks)})"
    if list(counts.values()).count(top) > 1:
        return f"{tensor} differs between ranks {span(ranks)} {members}, no majority to tell which is wrong"
    good = max(counts, key=counts.get)
    odd = [r for r, d in zip(ranks, digests) if d != good]
    agree = [r for r, d in zip(ranks, digests) if d == good]
    return f"{tensor} on rank{'s' if len(odd) > 1 else ''} {span(odd)} differs from ranks {span(agree)} {members}"


def span(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}-{r}" if r > start + 1 else f"{start}, {r}" if r == start + 1 else str(r))
            start = None
    return ", ".join(parts)
