"""Virtual pipeline stages (interleaved 1F1B; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", Sec. 2.2.2): the layers are split into pp*v chunks (equal, or parallel.pp_layers'
counts, engine/parallel/pp/split.py) and rank r holds
chunks r, r+pp, ..., r+(v-1)*pp (engine/parallel/pp/actions.py: rank-local chunk c is virtual stage c*pp + r).

A rank still holds *one* stage module (the Llama with the other ranks' layers dropped, layers under their global
names), so checkpoints, the tied embedding and the dp modes see one module per rank whatever v is; the embedding
sits on rank 0 (it belongs to chunk 0) and the final norm and LM head on rank pp-1 (the last chunk). A
``ModelChunk`` is a view of one chunk's part of that module, which the executor runs as one virtual stage.

Example, 8 layers, pp=2, v=2: rank 0 holds layers 0,1 (chunk 0) and 4,5 (chunk 1); rank 1 holds 2,3 and 6,7.

ZB-V (``vshape``; engine/parallel/pp/schedules/zbv.py) places its 2 chunks in a V: rank r holds virtual stages r and
2pp-1-r, so rank 0 holds the embedding (chunk 0) and the final norm, LM head and loss (chunk 1). With 8 layers at
pp=2: rank 0 holds 0,1 and 6,7; rank 1 holds 2,3 and 4,5. A tied embedding is then one parameter on one rank.
"""

from __future__ import annotations

from torch import nn

from engine.model.transformer import decode
from engine.parallel.pp.actions import virtual_stage


class ModelChunk(nn.Module):
    """One virtual stage of a rank's stage module: its run of layers, plus the embedding on virtual stage 0 and
    the final norm and LM head on the last. The submodules are the stage module's own (shared, not copied)."""

    def __init__(self, stage: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.cfg = stage.cfg
        self.embed_tokens = stage.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): stage.model.layers[str(i)] for i in layers})
        self.norm = stage.model.norm if last else None
        self.lm_head = stage.lm_head if last else None
        self.sequence_shards = stage.model.sequence_shards  # sequence parallelism (engine/parallel/tp/layers.py)

    def forward(self, x, position_ids=None, doc_ids=None):
        """Token ids (b, s) on virtual stage 0, else hidden states (b, s, h); returns logits (b, s, V/tp) on
        the last virtual stage, hidden states (b, s, h) elsewhere."""
        h = decode(
            self.cfg, self.embed_tokens, self.layers.values(), self.norm, x, position_ids, doc_ids, self.sequence_shards
        )
        return self.lm_head(h) if self.lm_head is not None else h


def model_chunks(stage: nn.Module, pp: int, rank: int, v: int, vshape: bool = False) -> list[nn.Module]:
    """The modules the executor runs as this rank's virtual stages: the stage module itself when v == 1, else
    one ModelChunk per chunk (``vshape``: ZB-V's placement), over the layer runs executor.split_stage cut the stage
    by (``stage.chunk_layers``: even or parallel.pp_layers' uneven counts)."""
    if v == 1:
        return [stage]
    ranges = stage.chunk_layers
    stages = [virtual_stage(pp, rank, c, vshape) for c in range(v)]
    return [ModelChunk(stage, r, first=g == 0, last=g == pp * v - 1) for g, r in zip(stages, ranges)]
