"""FLOPs per token (PaLM's 6N + 12 L H Q T), the device peak table and MFU, against hand-computed figures and
torch.utils.flop_counter.FlopCounterMode run on the engine's model."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from engine.config import load
from engine.model import flops
from engine.model import transformer as model_lib
from engine.model.recompute import apply_activation_checkpointing


def tiny():
    return load(["--config", "configs/tiny.yaml"]).model


def test_tiny_by_hand():
    # tiny: h=256, 8 heads of 32, 4 kv heads, ffn 688, 4 layers, vocab 4096.
    # per layer: q, o 2*256*256 = 131072; k, v 2*256*128 = 65536; gate, up, down 3*256*688 = 528384 -> 724992
    # N = 4 * 724992 + 4096 * 256 (LM head) = 2899968 + 1048576 = 3948544; the input embedding does not count.
    m = tiny()
    assert flops.matmul_params(m) == 3948544
    # at T = 128: 6N = 23691264; 12 L H Q T = 12 * 4 * 8 * 32 * 128 = 1572864
    assert flops.attention_flops_per_token(m, 128) == 1572864
    assert flops.flops_per_token(m, 128) == 23691264 + 1572864
    # activation checkpointing recomputes each layer's forward but its down_proj (torch's checkpoint stops once
    # backward's saved tensors are rebuilt): + 2 * 4 * (724992 - 256 * 688) + 1572864 / 3
    assert flops.hardware_flops_per_token(m, 128, True) == 23691264 + 1572864 + 4390912 + 524288


def test_llama_3_2_1b():
    # 16 layers of h=2048, 32 heads of 64, 8 kv heads, ffn 8192, vocab 128256, tied: 1.236e9 matmul weights
    # (the tied embedding counted once, as the LM head); at T = 2048: 6N = 7.414e9, attention 0.805e9.
    m = load(["--config", "configs/llama-3.2-1b.yaml"]).model
    assert flops.matmul_params(m) == 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 128256 * 2048
    assert flops.flops_per_token(m, 2048) == pytest.approx(8.2198e9, rel=1e-4)


def test_matches_torch_flop_counter():
    # FlopCounterMode counts every matmul of forward + backward; under the math SDPA backend attention is two
    # bmm's over the full T x T, which is what 12 L H Q T counts (the flash kernels have no FLOP formula on CPU).
    cfg = load(["--config", "configs/tiny.yaml", "--model.num_layers", "2", "--train.seq_len", "32"])
    model = model_lib.build(cfg.model, device="cpu")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert counter.get_total_flops() == flops.flops_per_token(cfg.model, 32) * 2 * 32


class _AttentionCores(TorchDispatchMode):
    """Counts the attention core's forward runs (SDPA, whatever kernel it picks: its FLOPs on CPU have no formula)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.runs += "scaled_dot_product" in name and "backward" not in name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config", ["tiny.yaml", "tiny-moe.yaml"])
def test_recomputed_flops_are_what_backward_runs_again(config):
    """The hardware FLOPs above 'none' are what backward runs again, counted on the engine's model: under selective
    no matmul (FlopCounterMode: their outputs are kept) and each layer's attention core once more (4 H Q T a token);
    under full every core again and every matmul but a dense block's down_proj (torch.utils.checkpoint stops once
    backward's saved tensors are rebuilt; an MoE block's router-weighted expert outputs are saved, so all of it).
    The counter sees the matmuls only (the cores run as SDPA), so the cores are added by count."""
    cfg = load(["--config", f"configs/{config}", "--model.num_layers", "2", "--train.seq_len", "32"])
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33))
    measured = {}
    for mode in ("none", "full", "selective"):
        model = model_lib.build(cfg.model, device="cpu")
        apply_activation_checkpointing(model, mode)
        with FlopCounterMode(display=False) as counter, _AttentionCores() as cores:
            logits = model(ids[:, :-1])
            logits = logits[0] if isinstance(logits, tuple) else logits
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        measured[mode] = (counter.get_total_flops(), cores.runs)
    layers = cfg.model.num_layers
    assert [measured[m][1] for m in ("none", "full", "selective")] == [layers, 2 * layers, 2 * layers]
    attention = 4 * cfg.model.num_heads * cfg.model.head_dim * 32 * 2 * 32  # one core's forward, every token
    planned = [flops.hardware_flops_per_token(cfg.model, 32, m) * 2 * 32 for m in ("none", "full", "selective")]
    for mode, plan in (("full", planned[1]), ("selective", planned[2])):
        assert measured[mode][0] - measured["none"][0] + layers * attention == plan - planned[0] > 0, mode


@pytest.mark.parametrize(
    "name,dtype,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10G", "bf16", 125.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("cpu", "bf16", None),
    ],
)
def test_peak_table(name, dtype, peak):
    assert flops.peak_tflops(name, dtype) == peak


def test_mfu_and_errors():
    # 400 tokens/s/device of 1.25e12 FLOPs each = 500 TFLOP/s achieved; of a 1000 TFLOP/s peak that is 50 %.
    assert flops.mfu(400.0, 1.25e12, 1000.0) == pytest.approx(0.5)
    assert flops.mfu(400.0, 1.25e12, None) is None
    assert flops.device_peak_tflops(torch.device("cpu"), "bf16") is None
    assert flops.device_peak_tflops(torch.device("cpu"), "bf16", override=123.0) == 123.0
    with pytest.raises(ValueError, match="dtype='fp8'"):
        flops.peak_tflops("NVIDIA H100", "fp8")
