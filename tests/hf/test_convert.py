"""launch/convert.py (engine/hf/convert.py): Hugging Face folders out of and into checkpoints.

- export: a checkpoint saved at tp 2 x pp 2 with tied embeddings becomes a folder that
  ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load (sharded above
  --max-shard-size), whose logits equal the engine's for the same checkpoint (rel <= 1e-5).
- import: a folder written by transformers itself (a random LlamaForCausalLM) becomes a model-only checkpoint; the
  engine resumed from it gives transformers' logits, and 5 training steps at tp 2 x pp 2 equal 5 at tp 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.checkpoint.runs import run_phases
from tests.cli import run_script
from tests.dist import run_ranks
from tests.hf.sources import TIED, hf_source
from tests.numerics import rel_err


def engine_logits(argv: list[str], ids: torch.Tensor) -> tuple[torch.Tensor, Trainer]:
    """The tp-1 engine model resumed as ``argv`` says, and its logits on ids (b, s) -> (b, s, V)."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(ids)
    trainer.model.train()
    return logits, trainer


def compare(ckpt: Path, exported: Path, run: list[str], source: Path) -> dict:
    """Rank function (one rank): the exported folder's logits vs the engine's for ``ckpt``; the imported engine's
    logits vs the transformers model it came from; then 5 training steps from the import at tp 1."""
    import transformers

    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, trainer = engine_logits(
        [*TIED, "--checkpoint.resume", str(ckpt), "--train.out_dir", str(ckpt.parent / "out")], ids
    )
    with torch.no_grad():
        exported_rel = rel_err(ours, transformers.AutoModelForCausalLM.from_pretrained(str(exported))(ids).logits)
    text = "To be, or not to be"
    same_tokens = (
        transformers.AutoTokenizer.from_pretrained(str(exported))(text)["input_ids"]
        == trainer.tokenizer(text)["input_ids"]
    )
    ours, trainer = engine_logits(run, ids)
    with torch.no_grad():
        imported_rel = rel_err(ours, transformers.AutoModelForCausalLM.from_pretrained(str(source))(ids).logits)
    return {
        "exported_rel": exported_rel,
        "same_tokens": same_tokens,
        "imported_rel": imported_rel,
        "start": trainer.step,
        "loss": [r["loss"] for r in trainer.fit()],
    }


def test_export_then_import_round_trip(tmp_path):
    from engine.hf import convert as hf

    ckpt, exported, source, imported = (tmp_path / n for n in ("ckpt", "hf", "src", "imported"))
    hf_source(source)
    hf.import_hf(source, imported)
    run = [
        "--config",
        str(imported / "config.yaml"),
        "--train.seq_len",
        "32",
        "--train.steps",
        "5",
        "--log.progress",
        "false",
        "--train.out_dir",
        str(tmp_path / "out"),
    ]
    tp2pp2 = ["--parallel.tp", "2", "--parallel.pp", "2"]
    phases = [
        ("train", [*TIED, *tp2pp2, "--checkpoint.dir", str(ckpt), "--train.out_dir", str(tmp_path / "out")]),
        ("train", [*run, *tp2pp2]),
    ]
    _, from_import = run_ranks(run_phases, 4, phases)[0]

    cli = run_script("launch/convert.py", "export", ckpt, exported, "--max-shard-size", "400KB")
    assert cli.returncode == 0, cli.stderr[-2000:]
    shards = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1 and "lm_head.weight" not in shards  # sharded; the head is tied
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True

    got = run_ranks(compare, 1, ckpt, exported, run, source)[0]
    assert got["exported_rel"] <= 1e-5, f"exported logits differ by rel {got['exported_rel']:.2e}"
    assert got["same_tokens"]
    assert got["imported_rel"] <= 1e-5, f"imported logits differ by rel {got['imported_rel']:.2e}"
    assert got["start"] == from_import["start"] == 0 and len(got["loss"]) == 5
    assert from_import["loss"] == pytest.approx(got["loss"], rel=1e-5)


def test_convert_errors_exit_2_with_one_line(tmp_path):
    bad = run_script("launch/convert.py", "import", tmp_path / "nope", tmp_path / "c", timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'} is not a Hugging Face model folder: {tmp_path / 'nope' / 'config.json'} is missing"
    ]
