"""Autograd Functions that save for backward only what it needs, where autograd's op-by-op graph keeps more: the
RMSNorm (engine/model/transformer.py rms_norm) and SwiGLU's silu(gate) * up (the MLP, the MoE experts). Each gives
the values and gradients of the ops it replaces (the same kernels: bitwise equal, or to the order of a sum), and
engine/planning/activations.py counts what it saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNormFunction(torch.autograd.Function):
    """y = weight * (x.float() * rstd).to(x.dtype), rstd = 1 / sqrt(mean(x.float()^2) + eps), saving for backward
    only x as given and rstd (one fp32 value a row): the fp32 copy of a bf16 x, x_n and the product are recomputed
    in backward (Megatron's and Apex's fused norms keep the same), where autograd's op-by-op graph kept x in fp32
    (pow, mul) and x_n (the weight product): 16h bytes a token of two bf16 norms against 4h + 4 here (the output,
    the next linear's input, is saved by that linear). The same fp32 math as before in forward; backward computes
    the fp32 gradient dx = rstd (g - x_n mean(g x_n)), g = (dy weight) in x_n's dtype, then in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x.float() * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # x_n in fp32, recomputed
        cast = normed.to(x.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:  # sum over every token of dy * x_n, as autograd's mul reduces a broadcast
            grad_w = (grad * cast).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight).to(x.dtype).float()  # d(x_n) through the casts, as autograd's mul and to() give it
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up saving gate and up only: silu(gate), which the product saved too (f values a token), is
    recomputed in backward (Megatron's fused bias-SwiGLU keeps the same). Backward runs the kernels autograd ran:
    the product's gradients, then aten's silu_backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (Shazeer 2020), keeping gate and up for backward (``SwiGLUFunction``)."""
    return SwiGLUFunction.apply(gate, up)
