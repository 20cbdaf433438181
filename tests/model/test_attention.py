"""The attention kernel path per (device, dtype, mask, GQA) (engine/model/attention.py) and the planner's bytes for it.

- The pure selection function over a table of cases, CUDA ones included (decided without a GPU); on CPU the kernel
  torch itself picks for the model's actual SDPA calls (torch._fused_sdp_choice on the same arguments) is the path
  the planner assumes, for fp32 and bf16 autocast, with and without the document mask. With CUDA, the table's CUDA
  cases are checked the same way (torch._fused_sdp_choice on CUDA tensors; not run on the CPU-only machine).
- The repeated-k/v call (the CUDA efficient path, run here on CPU's kernel) gives the native-GQA result within
  1e-6 in fp32 (measured: 0, bit-equal, with and without the mask).
- The additive mask decode() builds once gives bit-equal results to the bool mask (fp32 and bf16).
- The planner's activation ledger (engine/planning/activations.py) matches the bytes autograd saves on each path:
  the document mask's (b, 1, s, s) in q's dtype once per micro-batch (each layer saved its own copy of a bool
  mask), the repeated k/v, and the math kernel's s x s softmax (rel 1e-3, the existing ledger test's tolerance:
  the loss's few scalars).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import load
from engine.metrics.memory import SavedActivations
from engine.model import attention as attn
from engine.model import transformer as model_lib
from engine.model.docmask import block_causal_mask, document_layout
from engine.parallel.tp.layers import vocab_parallel_cross_entropy
from engine.planning import activations as acts
from engine.planning.planner import with_layout

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
# (device, dtype, document mask, gqa, head_dim) -> path, by torch 2.13's sdp_utils rules (module docstring)
CASES = [
    ("cpu", FP32, False, True, 64, attn.CPU_FLASH),
    ("cpu", FP32, True, True, 64, attn.CPU_FLASH),
    ("cpu", BF16, True, False, 64, attn.CPU_FLASH),
    ("cpu", BF16, False, True, 64, attn.CPU_FLASH),
    ("cuda", BF16, False, True, 128, attn.FLASH),
    ("cuda", FP16, False, False, 128, attn.FLASH),
    ("cuda", BF16, True, True, 128, attn.EFFICIENT_REPEAT_KV),
    ("cuda", BF16, True, False, 128, attn.EFFICIENT),
    ("cuda", FP32, False, True, 128, attn.EFFICIENT_REPEAT_KV),
    ("cuda", FP32, False, False, 128, attn.EFFICIENT),
    ("cuda", FP32, True, True, 128, attn.EFFICIENT_REPEAT_KV),
    ("cuda", FP32, True, False, 64, attn.EFFICIENT),
    ("cuda", BF16, False, True, 512, attn.EFFICIENT_REPEAT_KV),  # flash takes head_dim <= 256 only
    ("cuda", FP32, False, False, 30, attn.MATH),
    ("cuda", BF16, True, False, 36, attn.MATH),  # unaligned head_dim
    ("cuda", torch.float64, False, False, 64, attn.MATH),
    ("mps", FP32, False, False, 64, attn.MATH),
]


@pytest.mark.parametrize("device,dtype,mask,gqa,head_dim,path", CASES)
def test_attention_path_table(device, dtype, mask, gqa, head_dim, path):
    assert attn.attention_path(device, dtype, mask, gqa, head_dim) == path


# cuDNN attention (first in torch's order on sm90 with a recent cuDNN) saves what the fused kernels save.
CUDA_BACKENDS = {
    attn.FLASH: {SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION},
    attn.EFFICIENT: {SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION},
    attn.MATH: {SDPBackend.MATH},
}
CUDA_BACKENDS[attn.EFFICIENT_REPEAT_KV] = CUDA_BACKENDS[attn.EFFICIENT]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the table above decides these without one")
@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "cuda"])
def test_cuda_kernel_is_the_path(case):
    _, dtype, mask, gqa, head_dim, path = case
    q = torch.randn(2, 8, 256, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    kv_heads = 2 if gqa and path != attn.EFFICIENT_REPEAT_KV else 8  # as attend() calls SDPA
    k, v = (torch.randn(2, kv_heads, 256, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    m = block_causal_mask(torch.arange(256, device="cuda").expand(2, 256) // 100) if mask else None
    choice = torch._fused_sdp_choice(q, k, v, m, 0.0, m is None, scale=None, enable_gqa=k.shape[1] != q.shape[1])
    assert SDPBackend(choice) in CUDA_BACKENDS[path]


SMALL = [
    "--config",
    "configs/tiny.yaml",
    "--model.hidden_size",
    "128",
    "--model.intermediate_size",
    "344",
    "--train.seq_len",
    "64",
    "--train.micro_batch_size",
    "2",
    "--train.global_batch_size",
    "4",
    "--model.num_layers",
    "2",
    "--log.progress",
    "false",
    "--parallel.backend",
    "gloo",
]
EOS = 0


def small(dtype: str, dp_mode: str, doc_mask: bool, kv_heads: int):
    cfg = load(SMALL + ["--data.document_mask", str(doc_mask).lower(), "--model.num_kv_heads", str(kv_heads)])
    return with_layout(cfg, dtype=dtype, dp_mode=dp_mode, zero_stage=1 if dp_mode == "zero" else 0)


def batch(cfg) -> tuple[torch.Tensor, dict]:
    """(b, s + 1) token ids with EOS tokens in the rows (several documents each), and the model's keyword inputs."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=gen)
    ids[:, 10::17] = EOS
    if not cfg.data.document_mask:
        return ids, {}
    position_ids, doc_ids = document_layout(ids[:, :-1], EOS)
    return ids, {"position_ids": position_ids, "doc_ids": doc_ids}


def run_and_measure(cfg) -> int:
    """One micro-batch through the model and the loss; the peak bytes autograd saved."""
    model = model_lib.build(cfg.model, device="cpu")
    if acts.mode(cfg) == "bf16":
        model = model.to(torch.bfloat16)
    ids, kwargs = batch(cfg)
    tracker = SavedActivations(model)
    with tracker.hooks(), torch.autocast("cpu", torch.bfloat16, enabled=acts.mode(cfg) == "autocast"):
        vocab_parallel_cross_entropy(model(ids[:, :-1], **kwargs), ids[:, 1:], None)
    return tracker.peak


BACKEND_PATH = {SDPBackend.FLASH_ATTENTION: attn.CPU_FLASH, SDPBackend.MATH: attn.MATH}


@pytest.mark.parametrize("doc_mask", [False, True])
@pytest.mark.parametrize("dtype,kv_heads", [("fp32", 4), ("fp32", 8), ("bf16", 4)])
def test_cpu_kernel_is_the_planned_path(monkeypatch, dtype, kv_heads, doc_mask):
    # Every SDPA call the model makes is asked which kernel torch picks for exactly its arguments.
    cfg = small(dtype, "ddp", doc_mask, kv_heads)
    chosen, sdpa = [], attn.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        dtype = attn.compute_dtype(q)  # autocast casts q, k, v before the kernel choice
        args = (q.to(dtype), k.to(dtype), v.to(dtype), attn_mask, 0.0, is_causal)
        chosen.append(torch._fused_sdp_choice(*args, scale=None, enable_gqa=enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", spy)
    run_and_measure(cfg)
    assert len(chosen) == cfg.model.num_layers
    assert {BACKEND_PATH[SDPBackend(c)] for c in chosen} == {acts.planned_attention_path(cfg)}


def test_repeated_kv_equals_native_gqa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 40, 16, generator=gen)
    k, v = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)
    doc_ids = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    for mask in (None, block_causal_mask(doc_ids)):
        native = attn.attend(q, k, v, mask)  # CPU flash, enable_gqa
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attn, "attention_path", lambda *a: attn.EFFICIENT_REPEAT_KV)
            repeated = attn.attend(q, k, v, mask)
        torch.testing.assert_close(repeated, native, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_additive_mask_equals_the_bool_mask(dtype):
    # decode() hands the layers one additive mask instead of the bool one SDPA would convert in every layer
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 48, 16, generator=gen).to(dtype) for heads in (8, 2, 2))
    mask = block_causal_mask(torch.tensor([[0] * 15 + [1] * 33, [0] * 30 + [1] * 18]))
    additive = attn.attend(q, k, v, attn.additive_mask(mask, dtype))
    assert torch.equal(additive, attn.attend(q, k, v, mask))
    assert not torch.equal(additive, attn.attend(q, k, v, None))  # the mask matters in these rows


@pytest.mark.parametrize("dtype,dp_mode", [("fp32", "ddp"), ("bf16", "ddp"), ("bf16", "zero")])
def test_ledger_counts_the_document_mask(dtype, dp_mode):
    cfg = small(dtype, dp_mode, True, 4)
    planned = acts.micro_batch_bytes(cfg, 1, 1, 0, cfg.model.num_layers)
    assert run_and_measure(cfg) == pytest.approx(planned, rel=1e-3)


@pytest.mark.parametrize("path", [attn.EFFICIENT_REPEAT_KV, attn.MATH])
def test_ledger_follows_a_forced_path(monkeypatch, path):
    # The CUDA efficient path's repeated k/v, and the math kernel, run on CPU in fp32 (CPU's math upcasts bf16).
    cfg = small("fp32", "ddp", True, 4)
    fused = acts.micro_batch_bytes(cfg, 1, 1, 0, cfg.model.num_layers)
    monkeypatch.setattr(attn, "attention_path", lambda *a: path)
    monkeypatch.setattr(acts, "planned_attention_path", lambda cfg: path)
    planned = acts.micro_batch_bytes(cfg, 1, 1, 0, cfg.model.num_layers)
    with sdpa_kernel(SDPBackend.MATH if path == attn.MATH else SDPBackend.FLASH_ATTENTION):
        assert run_and_measure(cfg) == pytest.approx(planned, rel=1e-3)
    m, t = cfg.model, cfg.train
    scores = m.num_layers * t.micro_batch_size * m.num_heads * t.seq_len**2 * 4  # (b, a, s, s) fp32 a layer
    assert (planned - fused >= scores) == (path == attn.MATH)
