"""Bytes in the compute dtype (issue 24 item 5): under bf16 autocast over fp32 weights RoPE rotates q and k in
bf16 (tables in the hidden fp32 would promote them to fp32), and with parallel.p2p_dtype bf16 pipeline activations
and their gradients cross stages in bf16, half the p2p bytes of the fp32 parameter dtype (the receiving stage casts
them back to its residual dtype); the default keeps the weights' dtype, exact against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config import ModelConfig, load
from engine.model import transformer as model_lib
from engine.model.init import materialize
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.shrunk import SHRUNK

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("autocast", [False, True])
def test_rope_rotates_q_and_k_in_the_compute_dtype(monkeypatch, autocast):
    model = materialize(model_lib.build(CFG), torch.device("cpu"), seed=0, std=0.02)  # fp32 weights
    rotated = []
    rope = model_lib.apply_rope

    def spy(x, cos, sin):
        out = rope(x, cos, sin)
        rotated.append(out.dtype)
        return out

    monkeypatch.setattr(model_lib, "apply_rope", spy)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(torch.randint(0, CFG.vocab_size, (2, 8)))
    want = torch.bfloat16 if autocast else torch.float32
    assert rotated == [want, want]  # q and k of the one layer


def p2p_dtypes(argv: list[str]) -> dict:
    """Rank function: one training step at pp 2, recording the dtype and bytes of every p2p tensor."""
    seen = []
    post = dist.batch_isend_irecv

    def spy(ops):
        seen.extend((op.op.__name__, op.tensor.dtype, op.tensor.numel() * op.tensor.element_size()) for op in ops)
        return post(ops)

    dist.batch_isend_irecv = spy  # a forked rank: the patch dies with the process
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    history = trainer.fit()
    return {"ops": seen, "loss": history[-1]["loss"]}


SMALL = [
    "--config",
    "configs/tiny.yaml",
    *SHRUNK,
    "--train.steps",
    "1",
    "--train.global_batch_size",
    "4",
    "--train.micro_batch_size",
    "2",
    "--log.progress",
    "false",
    "--parallel.pp",
    "2",
]


@pytest.mark.parametrize("dtype,p2p", [("fp32", "auto"), ("bf16", "auto"), ("bf16", "bf16")])
def test_pipeline_activations_cross_in_parallel_p2p_dtype(tmp_path, dtype, p2p):
    """auto: the weights' dtype (fp32 under bf16 autocast: the residual stream, exact against one process);
    bf16: half the bytes."""
    ranks = run_ranks(
        p2p_dtypes, 2, [*SMALL, "--train.dtype", dtype, "--parallel.p2p_dtype", p2p, "--train.out_dir", str(tmp_path)]
    )
    want = torch.bfloat16 if p2p == "bf16" else torch.float32
    for rank in ranks:
        ops = rank["ops"]
        assert {name for name, _, _ in ops} == {"isend", "irecv"}  # activations one way, gradients the other
        assert {d for _, d, _ in ops} == {want}, ops
        # (mbs, s, h) per tensor: 2 x 32 x 64 values
        assert {n for _, _, n in ops} == {2 * 32 * 64 * want.itemsize}
