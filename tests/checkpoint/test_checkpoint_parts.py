"""The checkpoint seam (engine/checkpoint/parts.py, publish.py): a save takes explicit parts and a run position,
a load fills parts and hands the position back, and every checkpoint directory is published by one function.

- Parts saved at dp 2 with a position whose data count is not step x global batch (as after a change of
  global_batch_size) and loaded into a fresh trainer at tp 2: the trainer continues at that step, that data
  position, with the global batch the sampler places there, and the weights saved.
- A Hugging Face import that fails half-way (a tensor missing from the folder) publishes nothing: no
  checkpoint directory, and its temporary folder (beside it) is removed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.parts import RunPosition
from engine.checkpoint.publish import list_checkpoints
from engine.config import load
from engine.data import blend
from engine.data.dataset import GlobalBatchSampler
from engine.model.fused import by_hf_name
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.checkpoint.runs import SMALL
from tests.dist import run_ranks
from tests.hf.sources import hf_source

SAVED = RunPosition(step=5, consumed_samples=72)  # 4.5 global batches of 16: not derivable from the step


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Hugging Face name -> local value (a fused q/k/v or gate/up split into its parts: each is tp-chunked)."""
    values = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {n: t for n, (t, _, _) in by_hf_name(trainer.model, values).items()}


def save_then_load(root: str) -> dict:
    """Rank function (2 ranks): one step at dp 2, save from parts at SAVED; a fresh trainer at tp 2 resumes."""
    cfg = load([*SMALL, "--checkpoint.dir", root, "--checkpoint.resume", "none", "--train.out_dir", f"{root}/o"])
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())
    path = trainer.checkpointer.save(trainer.parts, SAVED)
    trainer.checkpointer.finish()
    saved = _weights(trainer)  # dp 2: every rank holds the full parameters
    cfg = load([*SMALL, "--parallel.tp", "2", "--checkpoint.resume", str(path), "--train.out_dir", f"{root}/o2"])
    fresh = Trainer(cfg, ParallelContext.from_config(cfg))
    out = {"step": fresh.step, "consumed": fresh.feed.consumed_samples, "resumed_from": fresh.checkpointer.resumed_from}
    batch = fresh.next_local_batch()  # dp 1: the whole global batch, on both tp ranks
    order = GlobalBatchSampler(fresh.feed.data.num_train_samples if fresh.feed.reads else 1, 16, cfg.train.seed)
    want = blend.batch_from(fresh.feed.data, order.batch(SAVED.consumed_samples)) if fresh.feed.reads else None
    out["batch_ok"] = want is None or torch.equal(batch.cpu(), want)
    out["consumed_after"] = fresh.feed.consumed_samples
    # Weights: the tp-2 shard of each parameter is the matching block of the dp-2 run's full one.
    full = {}
    for name, p in _weights(fresh).items():
        gathered = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(gathered, p.contiguous(), group=fresh.ctx.tp_group)
        dim = [d for d in range(p.dim()) if p.shape[d] != saved[name].shape[d]]
        full[name] = torch.cat(gathered, dim[0]) if dim else p
    out["weights_ok"] = all(torch.equal(full[n], saved[n]) for n in saved)
    return out


def test_parts_saved_at_dp2_resume_at_tp2_with_step_and_data_position(tmp_path):
    for got in run_ranks(save_then_load, 2, str(tmp_path / "c"), timeout_s=600):
        assert got["resumed_from"] == tmp_path / "c" / "step_000005"
        assert (got["step"], got["consumed"]) == (SAVED.step, SAVED.consumed_samples)
        assert got["batch_ok"], "the resumed run's first batch is not the one after 72 samples"
        assert got["consumed_after"] == SAVED.consumed_samples + 16
        assert got["weights_ok"], "the resumed weights are not the saved ones"


def test_failed_import_publishes_nothing(tmp_path):
    from engine.hf import convert as hf

    source, root = tmp_path / "src", tmp_path / "imported"
    hf_source(source)
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.norm.weight"]  # written last: the import fails after the other tensors' files
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor 'model.norm.weight'"):
        hf.import_hf(source, root, max_file_bytes=1 << 16)  # small files: some are written before the failure
    # Written into a temporary folder beside root (engine/checkpoint/folder.py), removed on the failure: no
    # checkpoint directory appears at all, and nothing is left beside it.
    assert not root.exists() and list_checkpoints(root) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
