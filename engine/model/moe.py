"""Mixture-of-experts feed-forward (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; Mixtral, Jiang et al.
2024): a router picks ``experts_per_token`` (k) of ``num_experts`` (E) SwiGLU experts per token and sums their
outputs weighted by the gate.

Gating, in each family's own order (its MoeSpec.gating, engine/kinds/families.py):
- ``topk_softmax`` (Mixtral): the top k of the router logits, softmax over those k;
- ``softmax_topk`` (Qwen2-MoE, Qwen3-MoE, OLMoE): softmax over all E, the top k of it, renormalised to sum 1 only
  with ``model.moe_norm_topk_prob``.
Ties are broken by a stable descending sort of the logits (the lower expert index wins), so every layout routes
alike and the parity matrix stays exact.

Dropless by default: the token copies are sorted by expert (stable, so token order within an expert is kept) and
run through ``Experts.forward(x_sorted, counts)``, one grouped GEMM (``torch.nn.functional.grouped_mm``) on CUDA,
a loop over experts elsewhere. ``model.moe_capacity_factor`` > 0 keeps at most ceil(cf * T * k / E) copies per
expert (the first in token order, Switch's policy) and counts the rest as dropped. Expert weights are stacked 3-D
tensors, gate_up_proj (E, 2 ffn, h) = [gate_e; up_e] and down_proj (E, h, ffn), as transformers 5 holds them, so
expert parallelism can later keep a slice of dim 0 and call the same ``Experts.forward`` on the tokens it receives.
On disk (checkpoints, HF export/import) each expert is its published per-expert tensors (``hf_blocks``).

The auxiliary losses do not change the forward's value: the router's load-balancing loss (Switch eq. 4-6, HF's
``load_balancing_loss_func`` for one layer: aux = E * sum_i f_i P_i, f_i the fraction of the k*T token copies
routed to expert i, P_i the mean router probability of i) and router z-loss (ST-MoE, Zoph et al. 2022, eq. 5:
z = mean_t logsumexp(logits_t)^2) are computed per layer over the T tokens of one micro-batch on one rank, and
their gradient enters backward through ``_AddLossGrad`` with weight coef / (moe layers * micro-batches) (set by
``set_loss_scale``): the step minimises CE + coef * (the mean over MoE layers and micro-batches, and over dp ranks
by the gradient average, of the per-micro-batch losses) - Megatron's micro-batch-level aux loss; summing f and P
over the whole global batch would need every micro-batch's forward before the first backward, which pipeline
schedules do not allow. The values are recorded (``records``) for engine/metrics/moe.py.

Under context parallelism a rank holds T/cp of the micro-batch's T tokens. f must be the micro-batch's: the counts
are summed over the cp ranks in forward (no gradient) by ``micro_batch_counts``, a hook engine/parallel/cp/ gives
the block (None: this rank holds the whole micro-batch). P_i and z are means over tokens, linear in them: each rank
takes its own T/cp tokens' mean, so its aux E sum_i f_i P_i^rank and its z average over the cp ranks to one
process's values, and the gradients, averaged over dp x cp as the cross-entropy's are (each cp rank's CE is the
mean over its T/cp tokens), equal one process's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.internals import in_backward
from engine.kinds.families import FAMILIES
from engine.model.lean_ops import swiglu


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether decoder layer ``index`` has the MoE block (model.moe_layers: all, or a list of layer indices)."""
    if not cfg.num_experts:
        return False
    return cfg.moe_layers == "all" or index in cfg.moe_layers


def moe_layer_count(cfg: ModelConfig) -> int:
    """How many decoder layers have the MoE block; 0 for an MoE family whose moe_layers lists none (``[]``, or HF's
    mlp_only_layers naming every layer): a dense model, which trains as one (no router, no auxiliary losses)."""
    return sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers))


def route(logits: torch.Tensor, k: int, gating: str, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) -> gate weights (T, k) fp32 and expert indices (T, k), best first."""
    ranked, idx = torch.sort(logits.float(), dim=-1, descending=True, stable=True)  # ties: lower index first
    idx = idx[:, :k]
    if gating == "topk_softmax":
        return torch.softmax(ranked[:, :k], dim=-1), idx
    weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, idx


def _disk(module_path: str, family: str) -> tuple[str, tuple[str, str, str]]:
    """('model.layers.3.block_sparse_moe', (w1, w3, w2)) for Mixtral's 'model.layers.3.mlp': the published
    checkpoints' per-expert tensor names, MoeSpec.disk (module holding the block, gate, up, down)."""
    block, *names = FAMILIES[family].moe.disk
    parent, _, _ = module_path.rpartition(".")
    return f"{parent}.{block}" if parent else block, tuple(names)


class Router(nn.Linear):
    """h -> E logits, no bias. Mixtral's is stored as block_sparse_moe.gate.weight."""

    def __init__(self, hidden: int, experts: int, family: str):
        super().__init__(hidden, experts, bias=False)
        self.family = family

    def hf_blocks(self, name: str, local_shape: torch.Size) -> list[tuple[str, int, torch.Size]]:
        block, _ = _disk(name.rpartition(".")[0].rpartition(".")[0], self.family)  # name: <mlp>.gate.weight
        return [(f"{block}.gate.weight", 0, torch.Size(local_shape))]


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: gate_up_proj (E, 2 ffn, h), down_proj (E, h, ffn)."""

    def __init__(self, experts: int, hidden: int, ffn: int, family: str):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.family = family
        self.first_expert = 0  # the global index of local expert 0 (expert parallelism keeps a slice of dim 0)

    def hf_blocks(self, name: str, local_shape: torch.Size) -> list[tuple[str, int, torch.Size]]:
        """The per-expert HF tensors of a stacked weight: expert e's gate and up rows (ffn, h) each, or its down
        (h, ffn), at flat offset e * (one expert's numel). ``local_shape[0]``: the experts held here."""
        module_path, _, attr = name.rpartition(".")  # '<mlp>.experts', 'gate_up_proj'
        block, (gate, up, down) = _disk(module_path.rpartition(".")[0], self.family)
        e_count, rows, cols = local_shape
        per, first = rows * cols, self.first_expert
        if attr == "down_proj":
            return [
                (f"{block}.experts.{first + e}.{down}.weight", e * per, torch.Size([rows, cols]))
                for e in range(e_count)
            ]
        half = torch.Size([rows // 2, cols])
        return [
            (f"{block}.experts.{first + e}.{part}.weight", e * per + j * half.numel(), half)
            for e in range(e_count)
            for j, part in enumerate((gate, up))
        ]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, h): token copies sorted by expert, counts (E_local,) copies per expert -> (N, h)."""
        if _grouped_mm_applies(x, self.gate_up_proj):
            return self._grouped(x, counts)
        out, at = [], 0
        # unbind: one (E, ...) gradient buffer per weight in backward (indexing [e] would allocate one per expert)
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for e, n in enumerate(counts.tolist()):  # one host sync per layer; experts without tokens skipped
            if n:
                gate, up = F.linear(x[at : at + n], gate_up[e]).chunk(2, dim=-1)  # (n, ffn) each
                out.append(F.linear(swiglu(gate, up), down[e]))
            at += n
        return torch.cat(out) if out else x.new_zeros(0, x.shape[-1])

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection (torch >= 2.9, CUDA sm80+: the rule transformers 5 applies), in bf16
        (its kernels' dtype); grouped_mm is not autocast-aware, so the cast is explicit."""
        offs = counts.cumsum(0).to(torch.int32)  # end of each expert's rows
        dtype = torch.bfloat16
        gu = F.grouped_mm(x.to(dtype), self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs)  # (N, 2 ffn)
        gate, up = gu.chunk(2, dim=-1)
        y = F.grouped_mm(swiglu(gate, up), self.down_proj.to(dtype).transpose(-2, -1), offs=offs)
        return y.to(x.dtype)


def _grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA sm80+ (torch >= 2.9's grouped_mm) computing in bf16 (autocast or bf16 weights); fp32 runs the exact
    loop, so fp32 parity holds on every device."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    autocast_bf16 = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    return autocast_bf16 or weight.dtype == torch.bfloat16


class _AddLossGrad(torch.autograd.Function):
    """Identity on x; in backward also sends d(total)/d(loss) = ``scale`` into ``loss`` (Megatron's
    MoEAuxLossAutoScaler), so a layer's auxiliary loss trains the router on any pipeline stage without being
    carried to the last one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class MoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert with its sigmoid gate): x (b, s, h) -> (b, s, h)."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        h, e = cfg.hidden_size, cfg.num_experts
        self.k, self.norm_topk_prob = cfg.experts_per_token, cfg.moe_norm_topk_prob
        self.gating = FAMILIES[cfg.family].moe.gating  # MoeSpec.gating: route's order of top-k and softmax
        self.capacity_factor = cfg.moe_capacity_factor
        self.gate = Router(h, e, cfg.family)
        self.experts = Experts(e, h, cfg.moe_intermediate_size or cfg.intermediate_size, cfg.family)
        self.shared_expert = shared
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared is not None else None
        # Set by set_loss_scale (engine/trainer.py): the coefficients and 1 / (MoE layers * micro-batches)
        self.aux_coef = self.z_coef = 0.0
        self.loss_scale = 1.0
        self.records: list[dict] = []  # per training forward: aux, z (detached), tokens per expert, dropped
        # (counts (E,), T) of this rank -> the micro-batch's; set under cp > 1 (engine/parallel/cp/apply.py)
        self.micro_batch_counts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)  # (T, h)
        logits = self.gate(flat)  # (T, E)
        weights, idx = route(logits, self.k, self.gating, self.norm_topk_prob)  # (T, k) each
        e = logits.shape[-1]
        order = torch.sort(idx.reshape(-1), stable=True).indices  # (T k,) copies grouped by expert, token order kept
        counts = torch.bincount(idx.reshape(-1), minlength=e)  # (E,)
        kept, kept_counts, dropped = self._capacity(order, counts, idx.reshape(-1))
        token = kept // self.k  # (N,) the token of each kept copy
        y = self.run_experts(flat[token], kept_counts)  # (N, h)
        y = y * weights.reshape(-1)[kept, None].to(y.dtype)  # (N, h) weighted as HF does, after down_proj
        out = torch.zeros_like(flat).index_add_(0, token, y.to(flat.dtype))  # per token: experts in index order
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        out = out.reshape(b, s, h).to(x.dtype)
        if self.training and torch.is_grad_enabled():
            out = self._aux_losses(out, logits, counts, dropped)
        return out

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, h) token copies sorted by expert, counts (E,) -> their (N, h) outputs, before the gate weights. A
        hook: tensor parallelism wraps it in its collectives (engine/parallel/tp/moe.py)."""
        return self.experts(x, counts)

    def _capacity(self, order: torch.Tensor, counts: torch.Tensor, flat_idx: torch.Tensor):
        """The kept copies (indices into the T k copies, sorted by expert), their counts per expert (E,), and how
        many copies were dropped (0 when dropless)."""
        if not self.capacity_factor:
            return order, counts, 0
        total, e = flat_idx.numel(), counts.numel()
        capacity = math.ceil(self.capacity_factor * total / e)
        starts = counts.cumsum(0) - counts  # (E,) first sorted position of each expert
        position = torch.arange(total, device=order.device) - starts[flat_idx[order]]  # rank within its expert
        keep = position < capacity
        return order[keep], counts.clamp(max=capacity), int(total - keep.sum())

    def _aux_losses(self, out: torch.Tensor, logits: torch.Tensor, counts: torch.Tensor, dropped: int):
        """Attach the layer's coef-weighted aux and z losses to ``out``'s backward; record their values."""
        probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
        total, tokens = counts, logits.shape[0]
        if self.micro_batch_counts is not None:  # cp: this rank's T/cp tokens -> the micro-batch's T (docstring)
            total, tokens = self.micro_batch_counts(counts, tokens)
        f = total.float() / tokens  # fraction of the T tokens sending a copy to each expert (sums to k)
        aux = logits.shape[-1] * (f * probs.mean(0)).sum()
        z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        if not in_backward():  # activation checkpointing re-runs the forward in backward: record once
            self.records.append({"aux": aux.detach(), "z": z.detach(), "counts": counts.detach(), "dropped": dropped})
        if self.aux_coef or self.z_coef:
            out = _AddLossGrad.apply(out, self.aux_coef * aux + self.z_coef * z, self.loss_scale)
        return out


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_loss_scale(model: nn.Module, cfg: ModelConfig, aux_coef: float, z_coef: float, micro_batches: int) -> None:
    """Give every MoE block of ``model`` (a stage) the loss coefficients and 1 / (MoE layers of the whole model
    * micro-batches per step), the weight of one layer's loss of one micro-batch in the step's mean."""
    layers = moe_layer_count(cfg)
    for block in moe_blocks(model):  # none when layers is 0
        block.aux_coef, block.z_coef = aux_coef, z_coef
        block.loss_scale = 1.0 / (layers * micro_batches)
