"""Llama 3.1 (llama3 RoPE scaling), Qwen2 (q/k/v biases, tied embeddings), Mistral and Qwen3 (head_dim of its own,
per-head q/k norms, tied embeddings) folders in and out.

For each family a tiny random model built by transformers itself (from a config object; nothing downloaded):
- at tp 1 our model computes its logits (rel <= 1e-5), Llama's at a sequence (48) longer than its
  original_max_position_embeddings (16), with random (non-zero) biases;
- imported with launch/convert.py, the engine at tp 2 x pp 2 gives the tp-1 logits (rel <= 1e-5), and 5 training
  steps there equal 5 at tp 1 (rel <= 1e-5, the tolerance between layouts in tests/trainer/test_train.py);
- --model.init_from SRC (no import step) at tp 2 x pp 2, and for Qwen2 also at fsdp dp 4, trains as the import;
- the tp2 x pp2 checkpoint exported loads in transformers as the same architecture with the engine's logits,
  and the tokenizer files and generation_config.json come through the round trip unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from engine.config import load
from engine.data.dataset import load_tokenizer
from engine.hf import convert as hf
from engine.hf import families
from engine.kinds.families import FAMILIES as FAMILY_SPECS
from engine.model import transformer as model_lib
from tests.cli import run_script
from tests.dist import run_ranks
from tests.hf.sources import FAMILIES, hf_model, ids, layout_logits, layout_phase
from tests.numerics import rel_err

TOL = 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_model_computes_the_hf_logits(family):
    source = hf_model(family)
    m = families.model_config(source.config.to_dict(), Path(family))
    assert m.family == family and m.attention_bias == (family == "qwen2")
    ours = model_lib.build(m, device="cpu").eval()
    ours.load_state_dict(source.state_dict(), strict=True)
    with torch.no_grad():
        rel = rel_err(ours(ids()), source(ids()).logits)
    assert rel <= TOL, f"{family}: logits differ by rel {rel:.2e}"


def run(imported: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(imported / "config.yaml"),
        "--train.seq_len",
        "32",
        "--train.global_batch_size",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.steps",
        "5",
        "--train.warmup_steps",
        "2",
        "--log.progress",
        "false",
        "--train.out_dir",
        str(out),
        *extra,
    ]


def reference_phase(argv: list[str], ckpt: Path) -> dict:
    """Rank function (one rank): tp-1 logits and losses, then the logits of the checkpoint ``ckpt``."""
    got = layout_phase(argv, ckpt.parent / "tp1_ckpt")
    got["trained_logits"] = layout_logits([*argv, "--checkpoint.resume", str(ckpt)], ids())
    return got


def hf_source(family: str, folder: Path) -> transformers.PreTrainedModel:
    model = hf_model(family)
    model.save_pretrained(str(folder))
    load_tokenizer("").save_pretrained(str(folder))
    transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[2, 7]).save_pretrained(
        str(folder)
    )
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_tp2_pp2_train_export(family, tmp_path):
    src, imported, ckpt, exported = (tmp_path / n for n in ("src", "imported", "ckpt", "exported"))
    source = hf_source(family, src)
    cli = run_script("launch/convert.py", "import", src, imported)
    assert cli.returncode == 0, cli.stderr[-2000:]
    with torch.no_grad():
        want = source(ids()).logits
    tp2pp2 = ["--parallel.tp", "2", "--parallel.pp", "2"]
    # --model.init_from: the same run without the import step, at tp2 x pp2 and (Qwen2) at fsdp dp 4
    direct = [
        [*run(imported, tmp_path / "out")[2:], "--model.init_from", str(src), *layout]
        for layout in [tp2pp2, ["--parallel.dp_mode", "fsdp", "--train.micro_batch_size", "1"]]
    ]
    layout = run_ranks(
        layout_phase, 4, run(imported, tmp_path / "out", *tp2pp2), ckpt, direct if family == "qwen2" else direct[:1]
    )[3]
    ref = run_ranks(reference_phase, 1, run(imported, tmp_path / "out1"), ckpt)[0]
    assert rel_err(ref["logits"], want) <= TOL, f"tp1 vs transformers: {rel_err(ref['logits'], want):.2e}"
    assert rel_err(layout["logits"], ref["logits"]) <= TOL
    assert len(ref["loss"]) == 5 and layout["loss"] == pytest.approx(ref["loss"], rel=TOL)
    for losses in layout["init_from"]:
        assert losses == pytest.approx(ref["loss"], rel=TOL)

    hf.export(ckpt, exported)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(back).__name__ == FAMILY_SPECS[family].architecture
    with torch.no_grad():
        assert rel_err(back(ids()).logits, ref["trained_logits"]) <= TOL
    assert rel_err(ref["trained_logits"], ref["logits"]) > 1e-3  # training moved the weights that came back
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (src / name).read_bytes(), name
    assert json.loads((exported / "config.json").read_text())["architectures"] == [FAMILY_SPECS[family].architecture]


def test_unsupported_architecture_is_one_line_exit_2(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    cli = run_script("launch/convert.py", "import", tmp_path / "src", tmp_path / "ckpt", timeout=120)
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'src'}: architecture GPT2LMHeadModel is not supported; import handles "
        f"LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
        f"OlmoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"
    ]


def test_sequence_longer_than_sliding_window_is_refused():
    from engine.config import ConfigError

    assert load(["--model.sliding_window", "128", "--train.seq_len", "128"]).model.sliding_window == 128
    with pytest.raises(
        ConfigError,
        match=r"^train.seq_len=129 exceeds model.sliding_window=128; sliding-window "
        r"attention is not implemented",
    ):
        load(["--model.sliding_window", "128", "--train.seq_len", "129"])
    assert load(["--model.max_position_embeddings", "64", "--train.seq_len", "64"]).model.max_seq_len == 64
