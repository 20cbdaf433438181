"""Activation checkpointing of decoder blocks: ``train.activation_checkpointing: none | full | selective``.

full: keep only each block's input and recompute the whole block in backward (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"). selective: keep the outputs of the matrix multiplies and recompute the cheap
rest in backward: norms, RoPE, the attention core (SDPA) and the SwiGLU elementwise ops. Tensor parallelism's
all-reduces are recomputed as under full: they are in-place (engine/parallel/autograd/comm.py), and a cached in-place
collective would hand back the un-reduced input (measured: wrong gradients at tp = 2). That is op-level selective
activation checkpointing as torchtitan does it
(``torch.utils.checkpoint`` with a ``create_selective_checkpoint_contexts`` policy); in the spirit of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 5), which recompute the
attention core because it stores much and costs little to redo. The saved bytes are counted by
engine/planning/activations.py.

Blocks are not wrapped in another module (parameter names stay Hugging Face's): each DecoderLayer reads its
``recompute`` attribute and runs engine/model/recompute_run.py's ``run_block``, so torch.compile of a block
(engine/model/compile.py) sees the checkpoint inside it. The modes are declared in engine/kinds/recompute.py
(``RECOMPUTE``: what the planner counts for each), which the config checks read before torch is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kinds.recompute import RECOMPUTE

if TYPE_CHECKING:
    from torch import nn


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Set every decoder block of ``model`` (a Llama, possibly a pipeline stage) to recompute in ``mode``."""
    if mode not in RECOMPUTE:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(RECOMPUTE)}")
    for layer in model.model.layers.values():
        set_recompute(layer, mode)


def set_recompute(layer: nn.Module, mode: str) -> None:
    """One decoder block recomputes in ``mode``. A module that runs another operator under selective recomputation
    (the sequence-parallel row-parallel linear: one operator whose (b, s/tp, h) output the policy keeps,
    engine/model/recompute_run.py save_under_selective) says so by an ``in_selective_block`` attribute: set here,
    once, not read from a context variable at run time (dynamo cannot trace ContextVar.set: a graph break in every
    compiled block)."""
    layer.recompute = mode
    selective = RECOMPUTE[mode].recomputes and RECOMPUTE[mode].keeps_matmul_outputs
    for module in layer.modules():
        if hasattr(module, "in_selective_block"):
            module.in_selective_block = selective
