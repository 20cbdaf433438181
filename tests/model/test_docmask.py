"""Document masking of packed sequences (engine/model/docmask.py, data.document_mask).

- A packed row of three documents gives the logits and the gradients of running each document on its own, in
  fp64 so that equal means equal: rel <= 1e-10 (measured 3e-16 logits, 3e-14 gradients; in fp32 the gradients
  differ by ~2e-5 from summation order alone). q/k/v biases and llama3 RoPE scaling are on so that restarting
  positions matter; without the mask the same row does not match.
- Training with data.document_mask at tp 2 x pp 2, at dp 4 (fsdp) and at pp 4 (middle stages then read the
  tokens too) gives the single-process losses (rel <= 1e-5, the tolerance between layouts), which differ from
  the unmasked run's (by ~4e-4): the data are short paragraphs, several to a 32-token row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model import transformer as model_lib
from engine.model.docmask import document_layout
from engine.model.init import materialize
from tests.checkpoint.runs import SMALL, run_phases
from tests.cli import ROOT
from tests.dist import run_ranks

EOS = 0
CFG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention_bias=True,
    rope_scaling="llama3",
    rope_factor=8.0,
    rope_original_max_position_embeddings=8,
    family="qwen2",
)


def documents() -> list[torch.Tensor]:
    """Three documents (lengths 7, 12, 9), each ending with EOS but the last (cut by the row's end)."""
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, CFG.vocab_size, (n,), generator=gen) for n in (7, 12, 9)]
    return [torch.cat([d[:-1], torch.tensor([EOS])]) for d in docs[:2]] + [docs[2]]


def test_document_layout_restarts_positions_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 3]])
    positions, doc_ids = document_layout(ids, EOS)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    assert doc_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3]]


def _model() -> torch.nn.Module:
    model = materialize(model_lib.build(CFG), torch.device("cpu"), seed=5, std=0.02).double()
    with torch.no_grad():  # non-zero biases (they start at 0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def _logits_and_grads(model, rows: list[torch.Tensor], masked: bool) -> tuple[torch.Tensor, dict]:
    """Concatenated logits of ``rows`` (each run as one sequence) and the gradient of a per-token loss."""
    model.zero_grad()
    outs = []
    for row in rows:
        x = row.unsqueeze(0)  # (1, s)
        kwargs = dict(zip(("position_ids", "doc_ids"), document_layout(x, EOS))) if masked else {}
        outs.append(model(x, **kwargs)[0])  # (s, V)
    logits = torch.cat(outs)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
    (logits * weights).sum().backward()  # a sum over tokens: the packed loss is the sum of the documents'
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_row_equals_each_document_alone():
    model, docs = _model(), documents()
    packed = torch.cat(docs)
    want, want_grads = _logits_and_grads(model, docs, masked=False)
    got, got_grads = _logits_and_grads(model, [packed], masked=True)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-10, f"logits differ by rel {rel:.2e}"
    for name, g in want_grads.items():
        err = ((got_grads[name] - g).abs().max() / g.abs().max()).item()
        assert err <= 1e-10, f"gradient of {name} differs by rel {err:.2e}"
    unmasked, _ = _logits_and_grads(model, [packed], masked=False)
    assert ((unmasked - want).abs().max() / want.abs().max()).item() > 1e-2  # the mask is what makes it equal


MASKED = [
    *SMALL,
    "--data.document_mask",
    "true",
    "--train.steps",
    "3",
    "--train.global_batch_size",
    "8",
    "--train.micro_batch_size",
    "2",
    "--model.attention_bias",
    "true",
    "--model.family",
    "qwen2",
    "--model.num_layers",
    "4",
]


def paragraphs(path: Path) -> None:
    """A jsonl of short documents (the bundled corpus's paragraphs): a 32-token row packs several of them."""
    text = (ROOT / "engine" / "assets" / "corpus.txt").read_text()
    docs = [d.strip() for d in text.split("\n\n") if d.strip()][:400]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def test_document_mask_at_tp_pp_dp(tmp_path):
    paragraphs(tmp_path / "docs.jsonl")
    argv = [
        *MASKED,
        "--data.paths",
        str(tmp_path / "docs.jsonl"),
        "--train.out_dir",
        str(tmp_path / "out"),
        "--checkpoint.resume",
        "none",
    ]
    reference, unmasked = run_ranks(
        run_phases, 1, [("train", argv), ("train", [*argv, "--data.document_mask", "false"])]
    )[0]
    layouts = [["--parallel.tp", "2", "--parallel.pp", "2"], ["--parallel.dp_mode", "fsdp"], ["--parallel.pp", "4"]]
    got = run_ranks(run_phases, 4, [("train", [*argv, *layout]) for layout in layouts])[0]
    # At initialisation the loss is near log(V) either way; the mask still moves it far beyond the tolerance.
    assert max(abs(a - b) / b for a, b in zip(reference["loss"], unmasked["loss"])) > 1e-4
    for layout, run in zip(layouts, got):
        assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5), layout
