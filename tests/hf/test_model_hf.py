"""At tp = 1 our model is Hugging Face's LlamaForCausalLM: same parameter names, same logits (<= 1e-5)."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.config import ModelConfig
from engine.model import transformer as model_lib
from engine.model.init import materialize


def hf_config(m: ModelConfig) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_seq_len,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )


@pytest.mark.parametrize("kv_heads,tie,theta", [(4, False, 10000.0), (8, True, 500000.0), (2, False, 1e6)])
def test_logits_match_transformers_llama(kv_heads, tie, theta):
    m = ModelConfig(num_layers=2, num_kv_heads=kv_heads, tie_embeddings=tie, rope_theta=theta, vocab_size=512)
    ours = materialize(model_lib.build(m), torch.device("cpu"), seed=3, std=0.02).eval()
    hf = transformers.LlamaForCausalLM(hf_config(m)).eval()
    ours_sd = ours.state_dict()
    assert set(ours_sd) == set(hf.state_dict()), "parameter names differ from HF Llama"
    hf.load_state_dict(ours_sd, strict=True)
    ids = torch.randint(0, m.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-5, f"relative logit error {rel:.2e} > 1e-5"
