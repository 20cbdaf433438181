"""The model families: one ``FamilySpec`` per Hugging Face architecture of the engine's decoder
(engine/model/transformer.py: RMSNorm, RoPE, GQA, SwiGLU, HF parameter names), registered in ``FAMILIES``; its
name is ``model.family``. The config checks (the choices, experts only in an MoE family), the config.json import
and export (engine/hf/families.py, moe_families.py, config_json.py), the model (q/k norms, gating, the experts'
names on disk) and the planner (q/k norm parameters and activations) ask the spec; none compares a family's name.

| architecture          | q/k/v bias | q/k norm                 | sliding window                      | MoE gating   |
|-----------------------|------------|--------------------------|-------------------------------------|--------------|
| `LlamaForCausalLM`    | no         | -                        | -                                   | -            |
| `Qwen2ForCausalLM`    | yes        | -                        | `use_sliding_window` (off in 2.5)   | -            |
| `MistralForCausalLM`  | no         | -                        | `sliding_window` (null from v0.2)   | -            |
| `MixtralForCausalLM`  | no         | -                        | `sliding_window`                    | topk_softmax |
| `Qwen2MoeForCausalLM` | yes        | -                        | `use_sliding_window`                | softmax_topk |
| `OlmoeForCausalLM`    | no         | whole projection         | -                                   | softmax_topk |
| `Qwen3ForCausalLM`    | no         | per head (hd,), pre-RoPE | `use_sliding_window` (off; refused) | -            |
| `Qwen3MoeForCausalLM` | no         | per head (hd,), pre-RoPE | `use_sliding_window` (off; refused) | softmax_topk |

No torch, and nothing above engine/errors.py: the config checks read it before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import CheckpointError


class NoWindow:
    """config.json has no sliding window the engine reads (Llama, OLMoE): none imported, none written."""

    def read(self, hf: dict, source, architecture: str) -> int:
        return 0

    def write(self, window: int, architecture: str) -> dict:
        return {}


class SlidingWindow(NoWindow):
    """``sliding_window`` (a width, or null for none) applies to every layer (Mistral, Mixtral)."""

    def read(self, hf: dict, source, architecture: str) -> int:
        return int(hf.get("sliding_window") or 0)

    def write(self, window: int, architecture: str) -> dict:
        return {"sliding_window": window or None}


class UseSlidingWindow(NoWindow):
    """``sliding_window`` applies only with ``use_sliding_window`` true (Qwen2, Qwen2-MoE; off in Qwen2.5)."""

    def read(self, hf: dict, source, architecture: str) -> int:
        return int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0

    def write(self, window: int, architecture: str) -> dict:
        return {"use_sliding_window": bool(window), "sliding_window": window or None}


class LayerWindow(NoWindow):
    """``use_sliding_window`` applies a window only to the layers from max_window_layers on (Qwen3), which the
    engine does not compute: a folder with it on is refused, and export writes it off."""

    def read(self, hf: dict, source, architecture: str) -> int:
        if hf.get("use_sliding_window"):
            raise CheckpointError(
                f"{source}: use_sliding_window={hf['use_sliding_window']!r} is not supported for "
                f"{architecture} (engine/model/transformer.py has no sliding window for "
                f"its layers from max_window_layers on); use a config with use_sliding_window false"
            )
        return 0

    def write(self, window: int, architecture: str) -> dict:
        if window:
            raise CheckpointError(
                f"model.sliding_window={window} cannot be written as {architecture}, whose window "
                f"covers only some layers; set it to 0"
            )
        return {"use_sliding_window": False, "sliding_window": None}


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts part of a family (engine/model/moe.py; config.json keys: engine/hf/moe_families.py).

    ``gating``: topk_softmax (the top k logits, softmax over those k: Mixtral) or softmax_topk (softmax over all E,
    the top k, renormalised with norm_topk_prob). ``count_keys``: the config.json keys that may hold the expert
    count, read in order, the first written. ``norm_topk_key``: config.json carries norm_topk_prob (without it the
    k weights always sum to 1). ``layer_keys``: decoder_sparse_step, mlp_only_layers and moe_intermediate_size say
    which layers are MoE and each expert's width (else every layer, experts of intermediate_size).
    ``shared_expert``: shared_expert_intermediate_size behind a sigmoid gate (export also writes qkv_bias).
    ``hf_extra``: fixed keys export writes. ``disk``: the published per-expert tensors, (block module, gate, up,
    down), as in model.layers.3.block_sparse_moe.experts.0.w1.weight."""

    gating: str
    count_keys: tuple[str, ...] = ("num_experts",)
    norm_topk_key: bool = True
    layer_keys: bool = False
    shared_expert: bool = False
    hf_extra: dict = field(default_factory=dict)
    disk: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FamilySpec:
    """One family: ``architecture`` (config.json's architectures, and what export writes), ``config_class`` (the
    transformers config class export builds), ``qkv_bias`` (q/k/v biases, always, and none on o_proj),
    ``qk_norm`` (q/k RMSNorms of engine/model/transformer.py Attention: "projection", over the whole q / k
    projection, weights (nh hd,), (nkv hd,), OLMoE's; "head", one (hd,) weight each applied per head before RoPE,
    Qwen3's; None), ``window`` (how config.json says the sliding window), ``hf_extra`` (fixed keys export writes),
    ``moe`` (the MoE part; None: dense)."""

    name: str
    architecture: str
    config_class: str
    qkv_bias: bool = False
    qk_norm: str | None = None
    window: NoWindow = field(default_factory=NoWindow)
    hf_extra: dict = field(default_factory=dict)
    moe: MoeSpec | None = None


_NO_BIASES = {"attention_bias": False, "mlp_bias": False}
_QWEN3_MOE = MoeSpec("softmax_topk", count_keys=("num_experts", "num_local_experts"), layer_keys=True)

FAMILIES: dict[str, FamilySpec] = {
    s.name: s
    for s in (  # model.family -> its FamilySpec
        FamilySpec("llama", "LlamaForCausalLM", "LlamaConfig", hf_extra=_NO_BIASES),
        FamilySpec("qwen2", "Qwen2ForCausalLM", "Qwen2Config", qkv_bias=True, window=UseSlidingWindow()),
        FamilySpec("mistral", "MistralForCausalLM", "MistralConfig", window=SlidingWindow()),
        # Mixtral writes its count as num_local_experts, always normalises (softmax over the k) and names its experts
        # block_sparse_moe.experts.e.w1 / w3 / w2
        FamilySpec(
            "mixtral",
            "MixtralForCausalLM",
            "MixtralConfig",
            window=SlidingWindow(),
            moe=MoeSpec(
                "topk_softmax",
                count_keys=("num_local_experts",),
                norm_topk_key=False,
                hf_extra={"router_jitter_noise": 0.0},
                disk=("block_sparse_moe", "w1", "w3", "w2"),
            ),
        ),
        FamilySpec(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "Qwen2MoeConfig",
            qkv_bias=True,
            window=UseSlidingWindow(),
            moe=MoeSpec("softmax_topk", layer_keys=True, shared_expert=True),
        ),
        FamilySpec("olmoe", "OlmoeForCausalLM", "OlmoeConfig", qk_norm="projection", moe=MoeSpec("softmax_topk")),
        FamilySpec(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3Config",
            qk_norm="head",
            window=LayerWindow(),
            hf_extra={"attention_bias": False},
        ),
        # transformers 5 writes Qwen3-MoE's count as num_local_experts (its attribute_map), the published config.json
        # as num_experts: both are read
        FamilySpec(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            qk_norm="head",
            window=LayerWindow(),
            hf_extra={"attention_bias": False},
            moe=_QWEN3_MOE,
        ),
    )
}
MOE_FAMILIES = tuple(name for name, s in FAMILIES.items() if s.moe)  # in registry order (messages list them)
