"""Which ranks read data, and how the others get their batches.

Only the pipeline's first stage (token ids) and last stage (labels) need a batch; middle stages read nothing,
unless data.document_mask is on: then every stage derives the document layout from the tokens.
Within those stages only tp rank 0 opens the data; it broadcasts each batch to its tp peers, which must see the
same tokens. The batch is split over dp only: the cp ranks of a dp rank each read the same (B/dp, s+1) rows
(context parallelism splits the sequence, not the batch; each keeps its tokens, engine/parallel/cp/inputs.py).
Every rank counts consumed samples (``consumed_samples``, the run's one data position: the sampler
holds none), so the position is known everywhere (checkpoints); ``seek`` moves it on resume.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from engine.config import Config
from engine.data import blend
from engine.data import dataset as data_lib
from engine.parallel.layout.context import ParallelContext
from engine.trust import oplog


class BatchFeed:
    """This rank's (B/dp, s+1) slices of the global training batches and of the validation batches."""

    def __init__(self, cfg: Config, ctx: ParallelContext, tokenizer):
        self.cfg, self.ctx = cfg, ctx
        t = cfg.train
        self.local_shape = (t.global_batch_size // ctx.dp, t.seq_len + 1)
        # Document masking: every stage needs the tokens, to find the documents its attention must keep apart.
        self.needs_batch = ctx.is_first_stage or ctx.is_last_stage or cfg.data.document_mask
        self.reads = self.needs_batch and ctx.tp_rank == 0
        self.consumed_samples = 0
        self.data = self.sampler = None
        if self.reads:
            self.data = blend.TrainData(blend.spec_from_config(cfg), tokenizer)
            self.sampler = data_lib.GlobalBatchSampler(
                self.data.num_train_samples, t.global_batch_size, t.seed, dp_rank=ctx.dp_rank, dp_size=ctx.dp
            )

    def seek(self, consumed_samples: int) -> None:
        """Continue after ``consumed_samples`` global samples (a resume, at any dp size: the order is global)."""
        self.consumed_samples = data_lib.check_consumed(consumed_samples)

    def describe(self) -> str:
        return self.data.describe() if self.data is not None else "(this rank reads no data)"

    def _share(self, batch: torch.Tensor | None) -> torch.Tensor | None:
        """tp rank 0's batch on every tp peer of a stage that needs one; None on middle stages."""
        if not self.needs_batch:
            return None
        if self.ctx.tp > 1:
            if batch is None:
                batch = torch.empty(self.local_shape, dtype=torch.long)
            batch = batch.to(self.ctx.device)
            with oplog.logged("broadcast", self.ctx.tp_group, "data", batch.numel() * batch.element_size()):
                dist.broadcast(batch, src=self.ctx.get_tensor_model_parallel_src_rank(), group=self.ctx.tp_group)
        return batch

    def next_train(self) -> torch.Tensor | None:
        """The next global batch's slice for this dp rank: (B/dp, s+1) token ids, or None on a middle stage."""
        batch = blend.batch_from(self.data, self.sampler.batch(self.consumed_samples)) if self.reads else None
        self.consumed_samples += self.cfg.train.global_batch_size
        return self._share(batch)

    def valid_batches(self, max_batches: int) -> Iterator[torch.Tensor | None]:
        """This dp rank's rows of each of the first ``max_batches`` validation batches (same on every rank)."""
        ctx = self.ctx
        count = torch.zeros((), dtype=torch.long, device=ctx.device)
        batches = []
        if self.reads:
            batches = list(self.data.valid_batches(self.cfg.train.global_batch_size, max_batches))
            count.fill_(len(batches))
        # Every rank of the job must run the same number of forward passes: the readers tell the rest.
        with oplog.logged("all-reduce", None, "data", 8):
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for i in range(int(count.item())):
            local = batches[i].chunk(ctx.dp)[ctx.dp_rank].contiguous() if self.reads else None
            yield self._share(local)
