"""The config.json keys the Hugging Face tests start from, shared by several test files: the model cards' of the
families with a sliding-window key (read as the shipped configs) and a tiny Llama's shape (the malformed-input
tests' base)."""

from __future__ import annotations

# The model cards' config.json (mistralai/Mistral-7B-v0.3, Qwen/Qwen2.5-0.5B, mistralai/Mixtral-8x7B-v0.1): the keys
# the import reads
COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "rope_scaling": None}
PUBLISHED_JSON = {
    "mistral-7b-v0.3": {
        **COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "qwen2.5-0.5b": {
        **COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,  # written, and off: use_sliding_window false
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
    "mixtral-8x7b": {
        **COMMON,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}

# A tiny Llama's shape: the malformed-input tests' base (tests/hf/test_hf_input.py, test_config_json_checks.py)
TINY = dict(
    vocab_size=4096,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
