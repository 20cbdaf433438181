"""The element-wise bytes the step-time model prices at the memory bandwidth (engine/planning/kernels.py) against
what one decoder layer's kernels move on CPU: every aten op that is neither a matmul nor attention nor a view,
its tensor inputs and outputs counted once (a TorchDispatchMode under the real DecoderLayer, forward and backward),
in fp32 and in bf16 weights (fsdp's ledger)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.config import load
from engine.model import transformer as model_lib
from engine.model.rope import rope_cos_sin
from engine.planning import kernels
from engine.planning.planner import with_layout
from engine.planning.search import Hardware, step_time

PRICED_AT_PEAK = ("mm", "addmm", "bmm", "attention", "linear", "matmul")  # matmul FLOPs, not bytes
VIEWS = ("_unsafe_view",)  # returns no alias annotation, moves no bytes


class MovedBytes(TorchDispatchMode):
    """Bytes read and written by the element-wise kernels dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not aliases and not any(k in name for k in PRICED_AT_PEAK + VIEWS):
            self.total += sum(t.nbytes for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def _cfg(dtype: str):
    argv = ["--config", "configs/tiny.yaml", "--model.hidden_size", "256", "--model.intermediate_size", "688"]
    return with_layout(load(argv), dtype=dtype, dp_mode="fsdp" if dtype == "bf16" else "ddp")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planned_elementwise_bytes_are_what_a_layer_moves(dtype):
    cfg, (b, s) = _cfg(dtype), (2, 64)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    layer = model_lib.DecoderLayer(cfg.model).to(torch_dtype)
    x = torch.randn(b, s, cfg.model.hidden_size, dtype=torch_dtype, requires_grad=True)
    cos, sin = rope_cos_sin(cfg.model, torch.arange(s), torch_dtype)
    fwd, bwd = MovedBytes(), MovedBytes()
    with fwd:
        y = layer(x, cos, sin, None)
    with bwd:
        y.backward(torch.randn_like(y))
    planned_fwd, planned_bwd = kernels.step_bytes_per_token(cfg, 1)
    # measured on this layer: forward 0.97x (fp32) and 0.98x (bf16) the planned bytes; backward 2.11x and 2.00x the
    # planned forward, where BACKWARD_PER_FORWARD takes 2
    assert fwd.total / (b * s) == pytest.approx(planned_fwd, rel=0.06)
    assert bwd.total / (b * s) == pytest.approx(planned_bwd, rel=0.06)


def test_a_wider_model_achieves_more_of_the_peak():
    """The element-wise bytes grow as h, the matmul FLOPs as h^2: with the links free, the share of the peak a step
    achieves (its MFU over the efficiency) rises with the hidden size, where one efficiency alone kept it flat."""
    hw = Hardware(peak_tflops=312.0, efficiency=0.5, intra_node_gbps=1e12, latency_us=0.0, hbm_gbps=2039.0)
    mfu = []
    for h in (256, 1024, 4096):
        cfg = with_layout(
            load(["--config", "configs/tiny.yaml", "--model.hidden_size", str(h), "--model.intermediate_size", str(h)]),
            dtype="bf16",
        )
        mfu.append(step_time(cfg, 1, hw).mfu)
    assert mfu == sorted(mfu) and mfu[-1] > 1.5 * mfu[0], mfu


def test_materialised_score_bytes_are_what_softmax_and_dropout_move():
    """MATERIALISED_SCORE_BYTES against the two kernels an attention that writes its scores runs over them, in bf16
    (Megatron-LM 2021's fused scale-mask-softmax, here torch's one softmax kernel, and the attention dropout with its
    1-byte mask: aten's native_dropout, the fused kernel CUDA runs; F.dropout on CPU decomposes it into four),
    forward and backward, per score element; and the planner adds them per token as a/t x s."""
    b, a, s = 2, 4, 32
    scores = torch.randn(b, a, s, s, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(scores)
    fwd, bwd = MovedBytes(), MovedBytes()
    with fwd:
        probs, _ = torch.ops.aten.native_dropout(torch.softmax(scores, dim=-1), 0.1, True)
    with bwd:
        probs.backward(grad)
    assert (fwd.total / scores.numel(), bwd.total / scores.numel()) == kernels.MATERIALISED_SCORE_BYTES
    cfg = _cfg("bf16")
    plain, with_scores = kernels.step_bytes_per_token(cfg, 2), kernels.step_bytes_per_token(cfg, 2, True)
    elements = cfg.model.num_heads / 2 * cfg.train.seq_len
    assert with_scores[0] - plain[0] == kernels.MATERIALISED_SCORE_BYTES[0] * elements
    assert with_scores[1] - plain[1] == kernels.MATERIALISED_SCORE_BYTES[1] * elements  # no recomputation here
