"""Mixtral, Qwen2-MoE, OLMoE and Qwen3-MoE folders in and out (engine/model/moe.py, moe_families.py).

For each family a tiny random model built by transformers 5 itself (nothing downloaded), whose save_pretrained
writes the published per-expert tensor names (model.layers.0.block_sparse_moe.experts.0.w1.weight for Mixtral,
mlp.experts.0.gate_proj.weight for the others):
- at tp 1 our model computes its logits (rel <= 1e-5, fp32), from transformers' in-model (fused-expert) state dict;
- imported with launch/convert.py, the engine at pp 2 and at tp 2 x ep 2 (dp 2, sequence parallel; experts
  tp-sharded, engine/parallel/tp/moe.py) gives the tp-1 logits, 4 training steps there (aux and z losses on) equal
  4 at one process, and so do 4 started at tp 2 x ep 2 straight from the HF folder (model.init_from); the
  checkpoint exported loads in transformers with the engine's logits.
Qwen2-MoE has a dense layer (mlp_only_layers) and a shared expert; Qwen3-MoE a dense layer, per-head q/k norms and
head_dim 24 on hidden 64 (4 heads); OLMoE's q/k norms and all norms and biases are perturbed (HF initialises them
to 1 and 0, which would hide a dropped one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from engine.config import ConfigError, load
from engine.hf import convert as hf
from engine.hf import families
from engine.kinds.families import FAMILIES as FAMILY_SPECS
from engine.model import transformer as model_lib
from tests.cli import run_script
from tests.dist import run_ranks
from tests.hf import sources
from tests.hf.sources import ids, layout_logits, train
from tests.numerics import rel_err

SHAPE = {**sources.SHAPE, "intermediate_size": 96}  # the dense families' shape, a narrower dense MLP
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0, eos_token_id=2
    ),
    # head_dim 24 != hidden / heads = 16; per-head q/k norms, a dense layer, no shared expert
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
}
TOL = 1e-5
# The logits after 4 steps at a layout against 4 at one process. Measured (fp32): <= 9e-6 at pp 2, <= 1.3e-5 at
# tp 2 x ep 2 (Mixtral): Adam's normalised steps amplify the reduction-order differences of near-zero gradients;
# a wrong gradient moves them by > 1e-3 (the trained-vs-untrained check below).
TRAINED_TOL = 1e-4


def hf_model(family: str) -> transformers.PreTrainedModel:
    return sources.hf_model(family, FAMILIES)


def engine_against_hf(family: str, source: transformers.PreTrainedModel):
    """(our ModelConfig of ``source``'s config.json, max relative difference of our logits from its logits)."""
    m = families.model_config(source.config.to_dict(), Path(family))
    ours = model_lib.build(m, device="cpu").eval()
    ours.load_state_dict(source.state_dict(), strict=True)
    with torch.no_grad():
        return m, rel_err(ours(ids()), source(ids()).logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_moe_computes_the_hf_logits(family):
    m, rel = engine_against_hf(family, hf_model(family))
    assert m.family == family and m.num_experts == 4
    assert m.moe_layers == ([1] if family in ("qwen2_moe", "qwen3_moe") else "all")
    assert rel <= TOL, f"{family}: logits differ by rel {rel:.2e}"


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_unnormalised_top_k_computes_the_hf_logits(family):
    """norm_topk_prob false (OLMoE-1B-7B's published value): the k softmax weights are used as they are, not
    renormalised to sum 1 (engine/model/moe.py moe_norm_topk_prob)."""

    def config():
        c = FAMILIES[family]()
        c.norm_topk_prob = False
        return c

    m, rel = engine_against_hf(family, sources.hf_model(family, {family: config}))
    assert m.moe_norm_topk_prob is False
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
        "4",
        "--train.warmup_steps",
        "2",
        "--train.moe_aux_loss_coef",
        "0.1",
        "--train.moe_z_loss_coef",
        "0.01",
        "--log.progress",
        "false",
        "--train.out_dir",
        str(out),
        *extra,
    ]


def phase(argv: list[str], ckpt: Path, trained: bool) -> dict:
    """Rank function: logits at argv's layout, 4 steps saved to ckpt (and the trained logits when asked)."""
    got = {"logits": layout_logits(argv, ids()), "loss": train([*argv, "--checkpoint.dir", str(ckpt)])}
    if trained:
        got["trained"] = layout_logits([*argv, "--checkpoint.resume", str(ckpt)], ids())
    return got


def trained_phase(argv: list[str], ckpt: Path, init_from: list[list[str]]) -> dict:
    """Rank function: test_families.layout_phase, then the logits of the checkpoint it saved, at its layout."""
    got = sources.layout_phase(argv, ckpt, init_from)
    return {**got, "trained": layout_logits([*argv, "--checkpoint.resume", str(ckpt)], ids())}


LAYOUTS = {
    "pp2": (2, ["--parallel.pp", "2"]),
    "tp2-ep2": (
        4,
        ["--parallel.tp", "2", "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.sequence_parallel", "true"],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_train_export_at_layout(family, layout, tmp_path):
    src, imported, exported = tmp_path / "src", tmp_path / "imported", tmp_path / "exported"
    source = hf_model(family)
    source.save_pretrained(str(src))
    cli = run_script("launch/convert.py", "import", src, imported)
    assert cli.returncode == 0, cli.stderr[-2000:]
    with torch.no_grad():
        want = source(ids()).logits
    world, extra = LAYOUTS[layout]
    # tp 2 x ep 2 also starts straight from the HF folder (--model.init_from: each rank reads its experts' rows;
    # the imported config.yaml stays for its MoE keys, which the layout check reads before the trainer adopts the
    # folder's shape as launch/pretrain.py does first)
    direct = (
        [[*run(imported, tmp_path / "od"), "--model.init_from", str(src), "--checkpoint.resume", "none", *extra]]
        if world == 4
        else []
    )
    at = run_ranks(trained_phase, world, run(imported, tmp_path / "o2", *extra), tmp_path / "ck2", direct)[world - 1]
    one = run_ranks(phase, 1, run(imported, tmp_path / "o1"), tmp_path / "ck1", True)[0]
    assert rel_err(one["logits"], want) <= TOL and rel_err(at["logits"], want) <= TOL
    assert len(one["loss"]) == 4 and at["loss"] == pytest.approx(one["loss"], rel=TOL)
    for losses in at["init_from"]:
        assert losses == pytest.approx(one["loss"], rel=TOL)
    hf.export(tmp_path / "ck2", exported)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(back).__name__ == FAMILY_SPECS[family].architecture
    with torch.no_grad():
        exported_logits = back(ids()).logits
    assert rel_err(exported_logits, at["trained"]) <= TOL  # the export is the engine's model at that layout
    assert rel_err(at["trained"], one["trained"]) <= TRAINED_TOL
    assert rel_err(one["trained"], one["logits"]) > 1e-3  # training moved the weights that came back


def test_what_the_moe_block_does_not_compute_is_refused_naming_the_key():
    from engine.checkpoint.format import CheckpointError

    mixtral = FAMILIES["mixtral"]().to_dict()
    with pytest.raises(
        CheckpointError,
        match=r"^src: router_jitter_noise=0.1 is not supported by "
        r"engine/model/moe.py \(0 only\)$",
    ):
        families.model_config({**mixtral, "router_jitter_noise": 0.1}, Path("src"))
    olmoe = FAMILIES["olmoe"]().to_dict()
    with pytest.raises(CheckpointError, match=r"^src: clip_qkv=8.0 is not supported"):
        families.model_config({**olmoe, "clip_qkv": 8.0}, Path("src"))
    with pytest.raises(ConfigError, match=r"^model.num_experts=0 with model.family=mixtral: MoE families"):
        load(["--model.family", "mixtral"])
    with pytest.raises(ConfigError, match=r"^model.experts_per_token=9 must be in \[1, model.num_experts=8\]"):
        load(["--config", "configs/tiny-moe.yaml", "--model.experts_per_token", "9"])
    with pytest.raises(ConfigError, match=r"^model.moe_layers=\[4\] must be all or a list of layer indices"):
        load(["--config", "configs/tiny-moe.yaml", "--model.moe_layers", "[4]"])


def test_a_qwen2_moe_folder_whose_mlp_only_layers_lists_every_layer_trains_as_dense(tmp_path):
    """Issue 42 item 8: a legal Qwen2-MoE config.json whose mlp_only_layers lists every layer imported, then
    trained with NaN losses from step 1 (the MoE losses averaged over zero MoE layers). It is a dense model: the
    engine computes transformers' logits of it and trains it."""
    config = lambda: transformers.Qwen2MoeConfig(  # noqa: E731
        **SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=list(range(SHAPE["num_hidden_layers"])),
    )
    source = sources.hf_model("qwen2_moe", {"qwen2_moe": config})
    m, rel = engine_against_hf("qwen2_moe", source)
    assert m.moe_layers == [] and rel <= TOL, (m.moe_layers, rel)
    source.save_pretrained(str(tmp_path / "src"))
    cli = run_script("launch/convert.py", "import", tmp_path / "src", tmp_path / "imported")
    assert cli.returncode == 0, cli.stderr[-2000:]
    out = run_script("launch/pretrain.py", *run(tmp_path / "imported", tmp_path / "o"), timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "no layer of this qwen2_moe model has experts" in out.stdout and "not finite" not in out.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
