"""What a save takes of a rank and a resume puts back (engine/checkpoint/contents.py), in one process:

- a save's pieces are copies: the training that goes on while an async save writes them does not change them;
  a sync save has committed (`latest`) when it returns, a weight gone NaN is not saved (one line naming it, `latest`
  stays), and the save's and the resume's timings (launch/bench/checkpoint.py's figures) lie within their calls;
- a resume at the layout that saved restores the rank's RNG streams (torch, Python, NumPy draw what they would
  have drawn after the save), from a checkpoint written at cp 1 by this engine or before cp existed (its layout
  without a "cp" key);
- a checkpoint resumed into a model with parameters it does not hold is one CheckpointError naming them;
- the resume line counts ranks in words ("1 rank", "2 ranks"); a changed data setting is quoted whole up to 80
  characters and cut to 77 + "..." beyond (data.paths may list thousands); a model-only checkpoint (an import)
  names no change of corpus, only of the tokenizer.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from types import SimpleNamespace

import numpy as np
import torch

from engine.checkpoint.contents import contents, data_changes, layout_change
from engine.checkpoint.parts import RunPosition
from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.checkpoint.runs import SMALL, edit_index
from tests.dist import run_ranks


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), np.random.rand(2).tolist()


def save_train_resume(root: str) -> dict:
    """Rank function (1 rank): a step, a save; the snapshot's pieces against the weights after a further step;
    then what the RNG streams draw after the save and after a resume at the same layout."""
    cfg = load([*SMALL, "--checkpoint.dir", root, "--checkpoint.resume", "none", "--train.out_dir", f"{root}/o"])
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())
    tensors, _, header = contents(trainer.parts, RunPosition(1, 16))
    pieces = {k: v for k, v in tensors.items() if "/param/" in k}
    before = {k: v.clone() for k, v in pieces.items()}
    trainer.train_step(trainer.next_local_batch())  # an async save's writer runs while this step updates in place
    out = {
        "pieces": len(pieces),
        "kept": all(torch.equal(pieces[k], before[k]) for k in pieces),
        "moved": sum(not torch.equal(before[k], v) for k, v in _weights(trainer, pieces).items()),
        "layout": header["layout"],
    }
    start = time.perf_counter()
    path = trainer.checkpointer.save(trainer.parts, RunPosition(2, 32))
    out["save_timings"] = (dict(trainer.checkpointer.timings), time.perf_counter() - start)
    out["latest_on_return"] = (path.parent / "latest").read_text().strip()  # a sync save has committed by then
    out["after_save"] = _draws()
    out["nan_save"] = _save_with_a_nan(trainer)
    trainer.checkpointer.finish()
    # as a checkpoint from before parallel.cp has it (its layout without a "cp" key): this engine's at cp 1
    edit_index(path, lambda index: index["layout"].pop("cp", None))
    again = load([*SMALL, "--checkpoint.resume", str(path), "--train.out_dir", f"{root}/again"])
    start = time.perf_counter()
    fresh = Trainer(again, ParallelContext.from_config(again))
    out["resumed"] = (fresh.step, _draws())
    out["load_timings"] = (dict(fresh.checkpointer.timings), time.perf_counter() - start)
    fresh.checkpointer.finish()
    # the same model as a mixture of experts: the same shape keys (check_model passes), parameters it never saved
    moe = ["--model.family", "mixtral", "--model.num_experts", "4", "--model.experts_per_token", "2"]
    other = load([*SMALL, *moe, "--checkpoint.resume", str(path), "--train.out_dir", f"{root}/moe"])
    try:
        Trainer(other, ParallelContext.from_config(other))
    except Exception as e:
        out["moe"] = f"{type(e).__name__}: {e}"
    return out


def _save_with_a_nan(trainer: Trainer) -> tuple:
    """One weight made NaN (as a diverged update leaves it), then a save: (its return, what it said, `latest`)."""
    weight = trainer.model.model.norm.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0] = float("nan")
    with contextlib.redirect_stdout(io.StringIO()) as said:
        got = trainer.checkpointer.save(trainer.parts, RunPosition(3, 48))
    with torch.no_grad():
        weight.copy_(kept)
    return got, said.getvalue(), (trainer.checkpointer.root / "latest").read_text().strip()


def _weights(trainer: Trainer, pieces: dict) -> dict:
    """The live values now under the snapshot's piece keys (flat ranges of each parameter, as the save cut them)."""
    tensors, _, _ = contents(trainer.parts, RunPosition(2, 32))
    return {k: tensors[k] for k in pieces}


def test_a_save_holds_copies_and_a_resume_at_its_layout_restores_the_rng(tmp_path):
    got = run_ranks(save_train_resume, 1, str(tmp_path / "c"), timeout_s=300)[0]
    assert got["pieces"] > 5 and got["moved"] > 5, got  # the step moved the weights the snapshot had copied
    assert got["kept"], "a save's pieces changed with the training after it: an async save writes other weights"
    assert "cp" not in got["layout"], got["layout"]  # at cp 1 as before cp: older checkpoints compare equal
    assert got["resumed"] == (2, got["after_save"]), "the RNG streams were not restored"
    assert got["latest_on_return"] == "step_000002", got["latest_on_return"]
    # a weight gone NaN is not saved: one line naming it, `latest` stays (one rank: no "and on N more ranks")
    assert got["nan_save"] == (
        None,
        "checkpoint: not saving step 3: rank 0 holds NaN/inf values in model.norm.weight/param; "
        "the latest checkpoint stays step_000002\n",
        "step_000002",
    ), got["nan_save"]
    # the phases launch/bench/checkpoint.py reports: each within the call that measured it
    for timings, wall in (got["save_timings"], got["load_timings"]):
        assert timings and all(0 <= t <= wall for t in timings.values()), (timings, wall)
    assert {"snapshot_s", "probe_s", "digest_s", "write_commit_s"} <= set(got["save_timings"][0])
    # and a sync save's phases follow one another inside it (digest_s lies within write_commit_s): they add up to
    # at most its wall time (mutc1: a probe_s that also counted the snapshot passed the bounds above)
    (save, wall) = got["save_timings"]
    assert save["snapshot_s"] + save["probe_s"] + save["write_commit_s"] <= wall, got["save_timings"]
    assert {"validate_s", "load_s", "verify_s"} <= set(got["load_timings"][0])
    assert got.get("moe", "").startswith("CheckpointError: "), got.get("moe")
    assert "has shape None, this model needs [" in got["moe"], got["moe"]


def test_the_resume_line_counts_ranks_in_words():
    cfg = SimpleNamespace(parallel=SimpleNamespace(dp_mode="ddp", zero_stage=0))
    one = SimpleNamespace(tp=1, pp=1, dp=1, world_size=1, size=lambda axis: 1)
    index = {"step": 4, "layout": {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}}
    assert layout_change(index, cfg, one) == (
        "resume: checkpoint step 4 was saved at tp1 pp1 dp2 (2 ranks); continuing at tp1 pp1 dp1 on 1 rank: "
        "the world shrank from 2 to 1"
    )


def test_a_changed_data_setting_is_quoted_whole_up_to_80_characters():
    def changes(paths: list[str], model_only: bool = False, tokenizer: str = "") -> list[str]:
        index = {"consumed_samples": 8, "config": {"data": {"paths": ["a"]}, "train": {}}, "model_only": model_only}
        index["config"]["data"]["tokenizer"] = ""
        cfg = SimpleNamespace(
            data=SimpleNamespace(tokenizer=tokenizer, paths=paths, weights=[]),
            train=SimpleNamespace(seed=1, seq_len=16, global_batch_size=8),
        )
        return data_changes(index, cfg)

    def notes(paths: list[str]) -> str:
        (line,) = changes(paths)
        return line.split(" -> ")[1].split(" (the checkpoint's")[0]

    assert changes(["b"], model_only=True) == []  # a model-only checkpoint (an import) starts on any data
    (line,) = changes(["b"], model_only=True, tokenizer="gpt2")  # but not with any tokenizer
    assert line.startswith("data.tokenizer '' -> 'gpt2' (the checkpoint's run had the first)"), line

    fits = ["x" * 76]  # repr: 80 characters
    assert notes(fits) == repr(fits)
    longer = ["x" * 77]
    assert notes(longer) == repr(longer)[:77] + "..." and len(notes(longer)) == 80


def test_the_cuda_random_state_is_restored_on_a_cuda_device_only(tmp_path, monkeypatch):
    """A rank's saved random states hold CUDA's where it ran on a GPU: resumed on a CUDA device it is set there; on
    a CPU run (a GPU checkpoint resumed on CPU) CUDA's state is left alone. torch.cuda.set_rng_state is recorded
    (on a CPU machine it is deferred until CUDA starts, so nothing else could tell)."""
    from safetensors.torch import save_file

    from engine.checkpoint import contents as module

    tensors, meta = module._rng_state(torch.device("cpu"))
    tensors["rng/cuda"] = torch.arange(16, dtype=torch.uint8)  # as torch.cuda.get_rng_state gives it
    save_file(tensors, str(tmp_path / "rng.safetensors"))
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state.tolist(), device)))
    module._set_rng_state(tmp_path / "rng.safetensors", meta, torch.device("cpu"))
    assert calls == []
    gpu = torch.device("cuda", 0)
    module._set_rng_state(tmp_path / "rng.safetensors", meta, gpu)
    assert calls == [(list(range(16)), gpu)]
