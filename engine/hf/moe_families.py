"""The MoE keys of the Hugging Face MoE families, both ways (engine/hf/families.py calls these), as each
family's ``MoeSpec`` (engine/kinds/families.py) declares them:

| family    | experts, k                             | expert width          | MoE layers           | gating (moe.py)  |
|-----------|----------------------------------------|-----------------------|----------------------|------------------|
| Mixtral   | num_local_experts, num_experts_per_tok | intermediate_size     | all                  | top-k, softmax/k |
| Qwen2-MoE | num_experts, num_experts_per_tok       | moe_intermediate_size | decoder_sparse_step, | softmax, top-k,  |
|           |                                        |                       | mlp_only_layers      | norm; shared     |
| OLMoE     | num_experts, num_experts_per_tok       | intermediate_size     | all                  | softmax, top-k,  |
|           |                                        |                       |                      | norm             |
| Qwen3-MoE | num_experts, num_experts_per_tok       | moe_intermediate_size | decoder_sparse_step, | softmax, top-k,  |
|           |                                        |                       | mlp_only_layers      | norm             |

(The architectures: FamilySpec.architecture.) "top-k, softmax/k": the top-k logits, softmax over the k;
"norm": norm_topk_prob.

Qwen2-MoE adds a shared expert (shared_expert_intermediate_size) behind a sigmoid gate, and q/k/v biases. Qwen3-MoE
has neither, and per-head q/k norms (FamilySpec.qk_norm); transformers 5 writes its expert count as
num_local_experts (Qwen3MoeConfig's attribute_map), the published config.json as num_experts: both are read
(MoeSpec.count_keys).
"""

from __future__ import annotations

from pathlib import Path

from engine.config import ModelConfig
from engine.errors import CheckpointError  # torch-free: the config checks read the families
from engine.kinds.families import FAMILIES


def moe_model_keys(hf: dict, family: str, source: Path) -> dict:
    """ModelConfig's MoE fields (and intermediate_size where the family's differs) from a config.json dict."""
    moe = FAMILIES[family].moe
    if moe is None:
        return {}
    if hf.get("router_jitter_noise"):
        raise CheckpointError(
            f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not supported by "
            f"engine/model/moe.py (0 only)"
        )
    experts = next((hf[k] for k in moe.count_keys if hf.get(k)), None)
    if not experts:
        raise CheckpointError(f"{source}: config.json of {family} has no expert count")
    out = {
        "num_experts": int(experts),
        "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
        "moe_norm_topk_prob": not moe.norm_topk_key or bool(hf.get("norm_topk_prob", False)),
    }
    if moe.layer_keys:
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
        layers = [i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]
        out.update(
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            moe_shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0),
            moe_layers="all" if len(layers) == hf["num_hidden_layers"] else layers,
        )
    return out


def moe_hf_keys(m: ModelConfig) -> dict:
    """The transformers config keys of our MoE fields (the inverse of moe_model_keys)."""
    moe = FAMILIES[m.family].moe
    if moe is None:
        return {}
    shared = " or ".join(name for name, s in FAMILIES.items() if s.moe and s.moe.shared_expert)
    if not moe.layer_keys and (
        m.moe_layers != "all" or m.moe_shared_expert_size or (m.moe_intermediate_size not in (0, m.intermediate_size))
    ):
        raise CheckpointError(
            f"model.family={m.family} has every layer MoE, no shared expert and experts of "
            f"intermediate_size; set model.moe_layers=all, moe_shared_expert_size=0, "
            f"moe_intermediate_size=0 or use family {shared}"
        )
    if not moe.shared_expert and m.moe_shared_expert_size:
        raise CheckpointError(
            f"model.moe_shared_expert_size={m.moe_shared_expert_size} cannot be written as "
            f"model.family={m.family}, which has no shared expert; set it to 0 or use family "
            f"{shared}"
        )
    k = {"num_experts_per_tok": m.experts_per_token, "output_router_logits": False, moe.count_keys[0]: m.num_experts}
    if moe.norm_topk_key:
        k["norm_topk_prob"] = m.moe_norm_topk_prob
    k.update(moe.hf_extra)
    if not moe.layer_keys:
        return k
    layers = range(m.num_layers) if m.moe_layers == "all" else m.moe_layers
    k.update(
        moe_intermediate_size=m.moe_intermediate_size or m.intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(m.num_layers) if i not in layers],
    )
    if not moe.shared_expert:
        return k
    return {**k, "shared_expert_intermediate_size": m.moe_shared_expert_size, "qkv_bias": True}
