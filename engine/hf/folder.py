"""A Hugging Face folder checked whole before anything is allocated, the one check shared by launch/convert.py import
(engine/hf/convert.py ``import_hf``) and ``--model.init_from`` (engine/hf/init.py).

``read_folder``: config.json read strictly (engine/json_input.py) and checked key by key (engine/hf/config_json.py,
through families.py ``model_config``); every weight file's safetensors header read (names and shapes only, no
data); then the model config.json describes compared with those headers: the layer count and the embedding first
(cheap, and they bound what the shapes of a meta model cost to build), then every tensor's name and shape. A
tensor the model has no place for is refused by name, except the known-harmless ones (``HARMLESS``), which are
returned so that the caller says it skips them. Before: ``vocab_size`` 10^12 with init_from allocated the
embedding before comparing it with the weights, and an extra tensor was dropped without a word.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from engine.checkpoint.format import CheckpointError
from engine.config import ModelConfig
from engine.hf.config_json import read_config_json
from engine.hf.families import model_config
from engine.json_input import load_object
from engine.model import transformer as model_lib
from engine.model.fused import part_blocks

# Tensors some folders hold that the model computes instead (name suffix -> why skipping them loses nothing):
# transformers before 4.31 saved each layer's RoPE inverse frequencies as a buffer.
HARMLESS = {"rotary_emb.inv_freq": "RoPE inverse frequencies, which the engine computes from rope_theta"}
SHOWN = 5  # names listed in a message; the count says how many more


@dataclass
class HfFolder:
    """A checked folder: the model its config.json describes, each tensor's file, the harmless tensors skipped."""

    model: ModelConfig
    where: dict[str, Path]
    skipped: list[str]


def param_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """HF names and shapes of every distinct parameter, in module order (a tied LM head is the embedding; a fused
    q/k/v or gate/up weight is its parts, engine/model/fused.py)."""
    model = model_lib.build(m, device="meta")
    modules = dict(model.named_modules())
    return {
        part: list(shape)
        for n, p in model.named_parameters()
        for part, _, shape in part_blocks(modules[n.rpartition(".")[0]], n, p.shape)
    }


def _weight_map(hf_dir: Path) -> dict[str, str] | None:
    """The sharded index's tensor name -> file name; None for a single ``model.safetensors``."""
    sharded, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
    if sharded.is_file():
        try:
            weight_map = load_index(sharded).get("weight_map")
        except CheckpointError:
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(
                f"{sharded} is not a safetensors index (JSON with a 'weight_map' of tensor name -> file name)"
            )
        return weight_map
    if single.is_file():
        return None
    raise CheckpointError(
        f"{hf_dir} has no model.safetensors or model.safetensors.index.json (save the model "
        f"with save_pretrained(..., safe_serialization=True) first)"
    )


def load_index(path: Path) -> dict:
    """A sharded folder's model.safetensors.index.json, read strictly (engine/json_input.py)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    return load_object(text, str(path), CheckpointError)


def _header(file: Path, listed_in: str) -> dict[str, list[int]]:
    """Tensor name -> shape from ``file``'s header (no data read); CheckpointError if it is missing, truncated or
    not safetensors."""
    if not file.is_file():
        raise CheckpointError(f"weight file {file}{listed_in} is missing")
    try:
        with safe_open(str(file), framework="pt") as f:  # checks that the header covers the file's bytes
            return {n: list(f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception as e:  # SafetensorError: truncated, or not a safetensors file
        raise CheckpointError(
            f"weight file {file}{listed_in} is not a readable safetensors file, truncated or damaged ({e})"
        ) from None


def tensor_shapes(hf_dir: Path) -> tuple[dict[str, Path], dict[str, list[int]]]:
    """(tensor name -> the safetensors file holding it, tensor name -> shape), from the single file or the sharded
    index, every file checked to exist, be readable and hold the tensors the index places in it."""
    weight_map = _weight_map(hf_dir)
    if weight_map is None:
        single = hf_dir / "model.safetensors"
        shapes = _header(single, "")
        return {n: single for n in shapes}, shapes
    listed_in = f" listed in {hf_dir / 'model.safetensors.index.json'}"
    held = {f: _header(hf_dir / f, listed_in) for f in sorted(set(weight_map.values()))}
    for name, f in weight_map.items():
        if name not in held[f]:
            raise CheckpointError(f"weight file {hf_dir / f} does not hold tensor '{name}'{listed_in}")
    return {n: hf_dir / f for n, f in weight_map.items()}, {n: held[f][n] for n, f in weight_map.items()}


def hf_tensors(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, checked as ``tensor_shapes`` does."""
    return tensor_shapes(hf_dir)[0]


def read_folder(folder: Path) -> HfFolder:
    """The folder's model and weights, checked against each other before anything is allocated."""
    m = model_config(read_config_json(folder), folder)
    where, got = tensor_shapes(folder)
    _check_outline(folder, m, got)
    try:
        want = param_shapes(m)  # a meta model: shapes only
    except (RuntimeError, ValueError, OverflowError) as e:  # sizes whose product overflows int64
        raise CheckpointError(f"{folder}: config.json describes tensors too large to exist ({e})") from None
    missing = [n for n in want if n not in got]
    if missing:
        raise CheckpointError(f"{folder}: the weights have no tensor '{missing[0]}'" + _more(missing))
    for name, shape in want.items():
        if got[name] != shape:
            raise CheckpointError(f"{where[name]}: {name} has shape {got[name]}, config.json implies {shape}")
    extra = [n for n in got if n not in want]
    skipped = [n for n in extra if n.endswith(tuple(HARMLESS))]
    unknown = [n for n in extra if n not in skipped]
    if unknown:
        tied = (
            " (tie_word_embeddings is true: the LM head is the embedding)"
            if m.tie_embeddings and "lm_head.weight" in unknown
            else ""
        )
        raise CheckpointError(
            f"{folder}: the weights hold {len(unknown)} tensor(s) the model of config.json has no "
            f"place for: {', '.join(unknown[:SHOWN])}{_more(unknown, SHOWN)}{tied}; remove them "
            f"or correct config.json (nothing is dropped silently)"
        )
    return HfFolder(m, where, skipped)


def skip_reason(name: str) -> str:
    """Why skipping ``name`` (one of ``HfFolder.skipped``) loses nothing."""
    return next(why for suffix, why in HARMLESS.items() if name.endswith(suffix))


def _more(names: list[str], shown: int = 1) -> str:
    return f" (and {len(names) - shown} more)" if len(names) > shown else ""


def _check_outline(folder: Path, m: ModelConfig, got: dict[str, list[int]]) -> None:
    """config.json's num_hidden_layers, vocab_size and hidden_size against the weights' layer indices and
    embedding, read from the headers alone: a size that is wrong is refused here, before a meta model of it
    (2**31 layers would take hours to build) or a real one (init_from: the embedding) exists."""
    layers = {int(n.split(".")[2]) for n in got if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if layers != set(range(m.num_layers)):
        held = f"layers 0..{max(layers)} ({len(layers)})" if layers else "no layers"
        raise CheckpointError(
            f"{folder}: config.json num_hidden_layers={m.num_layers}, but the weights hold {held}; "
            f"correct num_hidden_layers"
        )
    embed = got.get("model.embed_tokens.weight")
    if embed is not None and embed != [m.vocab_size, m.hidden_size]:
        raise CheckpointError(
            f"{folder}: config.json vocab_size={m.vocab_size} and hidden_size={m.hidden_size}, but "
            f"the weights' model.embed_tokens.weight is {embed}; correct config.json"
        )
