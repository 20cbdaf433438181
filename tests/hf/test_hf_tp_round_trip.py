"""A Hugging Face folder through tensor-parallel training and back (issue 14, done-means 2, the fused part).

A random ``LlamaForCausalLM`` (GQA: 4 heads, 2 kv heads) or ``Qwen2ForCausalLM`` (q/k/v biases, set random)
written by transformers itself is started from (``--model.init_from``: each tp rank reads its q/k/v and gate/up
rows into the fused weights), trained 5 steps at tp 2 (fused qkv_proj/gate_up_proj, 2 all-reduces backward per
layer), saved, and exported with engine/hf/convert.py. transformers' logits of the exported folder must equal the
engine's own logits after the 5 steps (gathered over tp): fp32, max|a - b| / max|b| <= 1e-5 (measured: ~3e-7).
The 5 steps must also have moved the model away from the source folder (so the comparison is not of unchanged
weights). ``LAYOUTS`` lists the parallel settings trained under: tp 2 with the fused layers, with and without
sequence parallelism.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.numerics import rel_err

REL = 1e-5
LAYOUTS = {"tp2": ["--parallel.tp", "2"], "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]}
SHAPE = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def hf_folder(folder: Path, family: str) -> None:
    """A random model saved by transformers, with the bundled tokenizer. Qwen2's q/k/v biases (zero after
    transformers' init) are drawn too, so a misplaced bias row would show."""
    import transformers

    from engine.data.dataset import load_tokenizer

    torch.manual_seed(2)
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.02)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    model.save_pretrained(str(folder))
    load_tokenizer("").save_pretrained(str(folder))


def train_and_save(argv: list[str]) -> torch.Tensor:
    """Rank function: train as ``argv`` says (saving at the last step), then the engine's logits on fixed ids,
    gathered over tp: (2, 32, V)."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.fit()
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        local = trainer.model(ids)  # (b, s, V/tp)
    parts = [torch.empty_like(local) for _ in range(trainer.ctx.tp)]
    dist.all_gather(parts, local.contiguous(), group=trainer.ctx.tp_group)
    return torch.cat(parts, dim=-1)


def hf_logits(folder: Path) -> torch.Tensor:
    import transformers

    ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float()(ids).logits


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_folder_trained_at_tp_exports_the_engine_logits(tmp_path, family, layout):
    from engine.hf import convert as hf

    source, ckpt, exported = tmp_path / "src", tmp_path / "ckpt", tmp_path / "exported"
    hf_folder(source, family)
    argv = [
        "--config",
        "configs/tiny.yaml",
        "--model.init_from",
        str(source),
        "--train.seq_len",
        "32",
        "--train.steps",
        "5",
        "--train.warmup_steps",
        "1",
        "--train.lr",
        "1e-3",
        "--train.global_batch_size",
        "4",
        "--train.micro_batch_size",
        "2",
        "--log.progress",
        "false",
        "--checkpoint.dir",
        str(ckpt),
        "--checkpoint.every",
        "5",
        "--checkpoint.resume",
        "none",
        "--train.out_dir",
        str(tmp_path / "out"),
        *LAYOUTS[layout],
    ]
    engine = run_ranks(train_and_save, 2, argv, timeout_s=600)
    hf.export(ckpt, exported)
    got = hf_logits(exported)
    assert rel_err(got, engine[0]) <= REL, f"exported logits differ from the engine's by {rel_err(got, engine[0])}"
    assert rel_err(hf_logits(source), engine[0]) > 1e-3, "5 steps did not change the model"
