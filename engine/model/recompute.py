"""Activation checkpointing of decoder blocks: ``train.activation_checkpointing: none | full | selective``.

full: keep only each block's input and recompute the whole block in backward (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"). selective: keep the outputs of the matrix multiplies and recompute the cheap
rest in backward: norms, RoPE, the attention core (SDPA) and the SwiGLU elementwise ops. Tensor parallelism's
all-reduces are recomputed as under full: they are in-place (engine/parallel/comm.py), and a cached in-place
collective would hand back the un-reduced input (measured: wrong gradients at tp = 2). That is op-level selective activation checkpointing as torchtitan does it
(``torch.utils.checkpoint`` with a ``create_selective_checkpoint_contexts`` policy); in the spirit of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 5), which recompute the
attention core because it stores much and costs little to redo. The saved bytes are counted by
engine/planning/activations.py.

Blocks are not wrapped in another module (parameter names stay Hugging Face's): each DecoderLayer reads its
``recompute`` attribute, so torch.compile of a block (engine/model/compile.py) sees the checkpoint inside it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
aten = torch.ops.aten
# Outputs kept under selective: the GEMMs (F.linear lowers to mm on 2-D views, addmm with a bias).
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def run_block(block: nn.Module, mode: str, *args) -> torch.Tensor:
    """``block._block(*args)`` with the recomputation ``mode`` in force while gradients are recorded."""
    if mode == "none" or not torch.is_grad_enabled():
        return block._block(*args)
    if mode == "full":
        return checkpoint(block._block, *args, use_reentrant=False)
    return checkpoint(block._block, *args, use_reentrant=False, context_fn=_selective_context)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Set every decoder block of ``model`` (a Llama, possibly a pipeline stage) to recompute in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(MODES)}")
    for layer in model.model.layers.values():
        layer.recompute = mode

