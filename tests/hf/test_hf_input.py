"""Malformed Hugging Face folders as a user meets them (issue 34, "lose nothing, round four", part B): through
``launch/convert.py import`` and ``launch/pretrain.py --model.init_from``, each is one ``error:`` line naming the key,
the value and what is valid, exit 2, before anything is allocated (engine/hf/config_json.py, folder.py).

Before: a config.json that is not JSON, a top-level list, ``"vocab_size": "big"``, ``hidden_size`` 32.5,
``rms_norm_eps`` "abc", ``rope_parameters`` a list, llama3 RoPE without ``factor``, Qwen2-MoE's
``decoder_sparse_step`` 0 or no ``moe_intermediate_size``, ``architectures`` a string, a key twice: tracebacks or a
letter-by-letter architecture list; ``rms_norm_eps`` NaN and ``num_experts_per_tok`` above the expert count were
imported; ``vocab_size`` 2**31 - 1 through init_from allocated a 256 GiB embedding before comparing it with the
weights; a tensor the model has no place for was dropped without a word.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.checkpoint.runs import SMALL
from tests.cli import launch, one_error_line, run_script
from tests.hf.cards import TINY

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
    ),
}
DROP = object()  # the key removed from config.json
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# id: (family, config.json change: {key: value or DROP} or the file's whole text, words the error line holds)
CASES = {
    "not-json": ("llama", '{"vocab_size": 4096,', ["config.json is not valid JSON (line 1"]),
    "top-level-list": ("llama", "[1, 2]", ["config.json holds a JSON list, not an object of keys"]),
    # past Python's int digit limit: json.loads raised ValueError (a traceback; issue 42)
    "integer-of-5000-digits": (
        "llama",
        '{"vocab_size": ' + "9" * 5000 + "}",
        ["config.json holds an integer of 5000 digits at line 1"],
    ),
    "key-twice": ("llama", '{"vocab_size": 4096, "vocab_size": 4096}', ["gives the key 'vocab_size' twice"]),
    "vocab-string": ("llama", {"vocab_size": "big"}, ['vocab_size="big" is not valid; use a whole number in [1, ']),
    "hidden-fraction": ("llama", {"hidden_size": 32.5}, ["hidden_size=32.5 is not valid; use a whole number"]),
    "eps-string": ("llama", {"rms_norm_eps": "abc"}, ['rms_norm_eps="abc" is not valid; use a finite number > 0']),
    "eps-nan": ("llama", {"rms_norm_eps": float("nan")}, ["rms_norm_eps=NaN is not valid; use a finite number > 0"]),
    # the bound itself: a zero epsilon divides by zero in every norm, a zero base makes every RoPE frequency 0
    "eps-zero": ("llama", {"rms_norm_eps": 0.0}, ["rms_norm_eps=0.0 is not valid; use a finite number > 0"]),
    "theta-zero": (
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
        ["rope_theta=0 is not valid; use a finite number > 0"],
    ),
    "rope-list": ("llama", {"rope_parameters": [1, 2]}, ["rope_parameters=[1, 2] is not valid; use an object"]),
    "llama3-no-factor": (
        "llama",
        {"rope_parameters": LLAMA3},
        ["rope_parameters has rope_type 'llama3' but no 'factor'"],
    ),
    "architectures-string": (
        "llama",
        {"architectures": "LlamaForCausalLM"},
        ['architectures="LlamaForCausalLM" is not valid; use a list of one class name'],
    ),
    "vocab-beyond-int32": (
        "llama",
        {"vocab_size": 10**12},
        ["vocab_size=1000000000000 is not valid; use a whole number in [1, 2147483647]"],
    ),
    # in range, but not the weights' (4096): refused from the headers before an embedding of 2**31 rows exists
    "vocab-not-the-weights": (
        "llama",
        {"vocab_size": 2**31 - 1},
        ["vocab_size=2147483647 and hidden_size=32, but the weights' model.embed_tokens.weight is [4096, 32]"],
    ),
    "layers-not-the-weights": (
        "llama",
        {"num_hidden_layers": 3},
        ["num_hidden_layers=3, but the weights hold layers 0..1 (2)"],
    ),
    "sparse-step-0": (
        "qwen2_moe",
        {"decoder_sparse_step": 0},
        ["decoder_sparse_step=0 is not valid; use a whole number in [1, "],
    ),
    "no-moe-width": (
        "qwen2_moe",
        {"moe_intermediate_size": DROP},
        ["config.json of qwen2_moe has no 'moe_intermediate_size'"],
    ),
    "k-over-experts": (
        "qwen2_moe",
        {"num_experts_per_tok": 5},
        ["num_experts_per_tok=5 is not valid; it must be at most num_experts=4"],
    ),
}
# The cases also run through init_from (each launch costs seconds: one of each kind of check)
INIT_FROM = (
    "not-json",
    "integer-of-5000-digits",
    "eps-nan",
    "architectures-string",
    "vocab-not-the-weights",
    "k-over-experts",
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model of each family, saved by transformers (nothing downloaded)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    for family, config in CONFIGS.items():
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(str(root / family))
    return {family: root / family for family in CONFIGS}


def changed(folders: dict[str, Path], tmp_path: Path, case: str) -> Path:
    family, change, _ = CASES[case]
    src = tmp_path / "src"
    shutil.copytree(folders[family], src)
    if isinstance(change, str):
        (src / "config.json").write_text(change)
        return src
    hf = json.loads((src / "config.json").read_text())
    for key, value in change.items():
        if value is DROP:
            del hf[key]
        else:
            hf[key] = value
    (src / "config.json").write_text(json.dumps(hf))  # NaN written as NaN, as Python's json (and transformers) do
    return src


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_config_json_is_one_line_at_import(folders, tmp_path, case):
    src = changed(folders, tmp_path, case)
    one_error_line(launch("convert.py", "import", src, tmp_path / "ckpt"), str(src), *CASES[case][2])
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("case", INIT_FROM)
def test_a_malformed_config_json_is_one_line_at_init_from(folders, tmp_path, case):
    src = changed(folders, tmp_path, case)
    out = launch("pretrain.py", *SMALL, "--model.init_from", src, "--train.out_dir", tmp_path / "o")
    line = one_error_line(out, str(src), *CASES[case][2])
    assert line.startswith("error: model.init_from: "), line


def with_tensors(folders: dict[str, Path], tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    src = tmp_path / "src"
    shutil.copytree(folders["llama"], src)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, **extra}, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def test_an_unexpected_tensor_is_refused_by_name(folders, tmp_path):
    src = with_tensors(
        folders, tmp_path, {"model.layers.0.mlp.extra_proj.weight": torch.ones(4, 4), "score.weight": torch.ones(2, 32)}
    )
    want = (
        "the weights hold 2 tensor(s) the model of config.json has no place for: "
        "model.layers.0.mlp.extra_proj.weight, score.weight"
    )
    one_error_line(launch("convert.py", "import", src, tmp_path / "ckpt"), want)
    one_error_line(
        launch("pretrain.py", *SMALL, "--model.init_from", src, "--train.out_dir", tmp_path / "o"),
        "error: model.init_from: ",
        want,
    )


def test_rotary_inv_freq_is_skipped_and_said_so(folders, tmp_path):
    """transformers before 4.31 saved each layer's RoPE inverse frequencies; the engine computes them."""
    name = "model.layers.1.self_attn.rotary_emb.inv_freq"
    src = with_tensors(folders, tmp_path, {name: torch.ones(4)})
    out = launch("convert.py", "import", src, tmp_path / "ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"import: skipping {name} (RoPE inverse frequencies, which the engine computes from rope_theta)"
        in out.stdout.splitlines()
    )


@pytest.mark.parametrize("how", ["mode 000", "not UTF-8"])
def test_an_unreadable_config_json_is_one_line(tmp_path, how):
    """A config.json that exists but cannot be read (mode 000, read as a user; bytes that are not UTF-8): one line
    naming it and why, exit 2, rather than the OSError's or UnicodeDecodeError's traceback."""
    src = tmp_path / "src"
    src.mkdir()
    path = src / "config.json"
    if how == "mode 000":
        path.write_text("{}")
        path.chmod(0)
    else:
        path.write_bytes(b'{"model_type": "\xff"}')
    out = run_script("launch/convert.py", "import", src, tmp_path / "ckpt", as_user=True, timeout=120)
    one_error_line(out, f"error: {path} cannot be read (", "Permission denied" if how == "mode 000" else "utf-8")
