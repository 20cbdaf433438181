"""Qwen3 and Qwen3-MoE beyond their folders in and out (tests/hf/test_families.py, tests/hf/test_moe_families.py): the
per-head q/k RMSNorms under tensor parallelism, model.head_dim != hidden_size / num_heads in the planner, and the
refusals of what the engine does not compute.

- One fp32 step of a tiny Qwen3 and Qwen3-MoE (head_dim 12 on hidden 32, 4 heads) on 2 tp ranks, with and without
  sequence parallelism: the loss and EVERY gradient equal tp 1's; the per-head q/k norm weights are whole on every
  rank and see only their nh/tp heads, so this fails when their gradient is not summed over tp.
- 4 training steps of a tiny Qwen3 (head_dim 12 on hidden 64, 8 heads) at tp 2, at tp 2 with sequence
  parallelism (and selective recomputation) and at cp 2 (ring and all_to_all) equal one process in loss, grad norm and
  parameters
  (tests/parity/runner.py's fp32 bounds).
- The planner: the parameters a tp rank holds, and the activation ledger against the bytes autograd saves, with
  q (nh hd) wider than hidden_size and the per-head norms' saved tensors.
- The model cards' config.json read into the shapes of configs/qwen3-0.6b.yaml and qwen3-30b-a3b.yaml.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.checkpoint.format import CheckpointError
from engine.config import ConfigError, ModelConfig, load
from engine.hf import families
from tests.dist import run_ranks
from tests.parallel.tp.moe_step import REL, _compare, _held
from tests.parity import runner
from tests.planning.measure import saved_and_planned

SHAPE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12
)  # q: 48 wide on hidden 32
FAMILIES = {
    "qwen3": ModelConfig(**SHAPE, family="qwen3"),
    "qwen3_moe": ModelConfig(
        **SHAPE, family="qwen3_moe", num_experts=4, experts_per_token=2, moe_intermediate_size=24, moe_layers=[1]
    ),
}
NORMS = ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_step_equals_tp1_in_loss_and_every_gradient(family, sp):
    for rank, errors in enumerate(run_ranks(_compare, 2, FAMILIES[family], sp, timeout_s=300)):
        assert all(name in errors for name in NORMS)  # the per-head norms are among the names compared
        worst = max(errors, key=errors.get)
        assert errors[worst] <= REL, (rank, worst, errors[worst])


QWEN3 = [*runner.BASE, "--model.family", "qwen3", "--model.head_dim", "12", "--train.grad_clip", "0"]


def test_training_at_tp2_and_cp2_equals_one_process(tmp_path):
    ref = runner.run_group(1, [[*QWEN3, "--train.out_dir", str(tmp_path / "ref")]], want_init=True)[0][0]
    assert "error" not in ref, ref
    layouts = [
        ["--parallel.tp", "2"],
        ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
        ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.activation_checkpointing", "selective"],
        ["--parallel.cp", "2"],
        ["--parallel.cp", "2", "--parallel.cp_mode", "all_to_all"],
    ]
    for extra, run in zip(layouts, runner.run_layouts(2, QWEN3, layouts, tmp_path)):
        runner.assert_matches(run, ref, extra)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_counts_the_parameters_a_tp_rank_holds(family):
    for held, planned in run_ranks(_held, 2, FAMILIES[family], timeout_s=300):
        assert held == planned, family


LEDGER = [*QWEN3, "--model.num_layers", "2", "--train.seq_len", "32", "--train.micro_batch_size", "2"]


@pytest.mark.parametrize("dtype,dp_mode", [("fp32", "ddp"), ("bf16", "ddp"), ("bf16", "zero")])
def test_micro_batch_ledger_matches_saved_tensors(dtype, dp_mode):
    # As tests/planning/test_planner.py's, for a model whose q (8 heads x 12 = 96) is wider than hidden (64), with the
    # per-head q/k norms' saved input, rsqrt and normalised values
    saved, planned = saved_and_planned(LEDGER, dtype, dp_mode)
    assert saved == pytest.approx(planned, rel=1e-3)


def test_what_qwen3_does_not_compute_is_refused_in_one_line():
    hf = families.hf_config(FAMILIES["qwen3"]).to_dict()
    with pytest.raises(
        CheckpointError,
        match=r"^src: use_sliding_window=True is not supported for "
        r"Qwen3ForCausalLM .*; use a config with use_sliding_window false$",
    ):
        families.model_config({**hf, "use_sliding_window": True, "sliding_window": 16}, Path("src"))
    with pytest.raises(CheckpointError, match=r"^src: attention_bias=True is not supported"):
        families.model_config({**hf, "attention_bias": True}, Path("src"))  # Qwen3's would bias o_proj too
    with pytest.raises(CheckpointError, match=r"^model.sliding_window=16 cannot be written as Qwen3ForCausalLM"):
        families.hf_config(ModelConfig(**SHAPE, family="qwen3", sliding_window=16))
    with pytest.raises(
        CheckpointError,
        match=r"^model.moe_shared_expert_size=8 cannot be written as model.family="
        r"qwen3_moe, which has no shared expert",
    ):
        families.hf_config(dataclasses.replace(FAMILIES["qwen3_moe"], moe_shared_expert_size=8))
    for value, words in (
        ("-2", r"^model.head_dim=-2 must be >= 0 \(0: hidden_size / num_heads\)$"),
        ("7", r"^model.head_dim=7 must be even for RoPE$"),
    ):
        with pytest.raises(ConfigError, match=words):
            load(["--model.head_dim", value])
    # a head_dim of its own lifts the divisibility of hidden_size by num_heads
    assert load(["--model.hidden_size", "100", "--model.head_dim", "16"]).model.head_dim == 16


def test_a_checkpoint_from_before_model_head_dim_resumes_and_another_head_dim_is_refused():
    from engine.checkpoint.contents import check_model

    old = {"config": {"model": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}}}  # no head_dim key
    check_model(Path("ck"), old, ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2))  # 16 both
    with pytest.raises(CheckpointError, match=r"was written for another model: model.head_dim=16 \(this run: 24\)"):
        check_model(Path("ck"), old, ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24))


# The model cards' config.json (Qwen/Qwen3-0.6B, Qwen/Qwen3-30B-A3B), the keys the import reads; the MoE one names
# its expert count num_experts, where transformers 5's save_pretrained writes num_local_experts (the round trips)
PUBLISHED_JSON = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
}
SHAPE_KEYS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_seq_len",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "attention_bias",
    "sliding_window",
    "num_experts",
    "experts_per_token",
    "moe_intermediate_size",
    "moe_layers",
    "moe_norm_topk_prob",
    "moe_shared_expert_size",
)


@pytest.mark.parametrize("name", list(PUBLISHED_JSON))
def test_the_published_config_json_reads_as_the_shipped_config(name):
    m = families.model_config(PUBLISHED_JSON[name], Path(name))
    shipped = load(["--config", f"configs/{name}.yaml"]).model
    assert {k: getattr(m, k) for k in SHAPE_KEYS} == {k: getattr(shipped, k) for k in SHAPE_KEYS}
