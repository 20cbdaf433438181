"""Attention's saved bytes per layer, per kernel path: planned for a real config, and measured on CPU.

    python launch/bench/attention.py [--config configs/llama-3.1-8b.yaml] [--micro-batch 4] [--seq 2048]
                                     [--measure-seq 512]

Part 1 prints, for the config at the issue's size (micro-batch 4, seq 2048), the path engine/model/attention.py
picks per (device, dtype, document mask) and the bytes one layer's attention saves for backward by the planner's
ledger (engine/planning/activations.py): q, k, v, output and log-sum-exp, plus the path's extra (mask copy,
repeated k/v, or math's s x s softmax), the document mask once per micro-batch, and the total of 32 layers. Next to
it, what the math kernel would hold (the fallback before this path selection). Part 2 measures on CPU (fp32, the
config's heads, one layer's SDPA call at --measure-seq tokens) the
bytes autograd saves on each path, forced, against the planner's figure for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from engine.config import load  # noqa: E402
from engine.model import attention as attn  # noqa: E402
from engine.model.docmask import block_causal_mask  # noqa: E402
from engine.planning import activations as acts  # noqa: E402
from engine.planning.planner import with_layout  # noqa: E402

MiB, GiB = 2**20, 2**30


def planned_attention(cfg, path: str) -> float:
    """(bytes one layer's attention saves for one micro-batch on ``path`` (tp 1): the fused kernels' q, k, v, output
    (in the compute dtype) and fp32 log-sum-exp, plus attention_bytes_per_token's extra; the document mask's bytes,
    once per micro-batch whatever the number of layers)."""
    m, t = cfg.model, cfg.train
    width = acts.logit_bytes(cfg)
    base = 2 * m.num_heads * m.head_dim * width + 2 * m.num_kv_heads * m.head_dim * width + 4 * m.num_heads
    real = acts.planned_attention_path
    acts.planned_attention_path = lambda c: path
    try:
        extra, mask = acts.attention_bytes_per_token(cfg, 1), acts.document_mask_bytes(cfg, 1)
    finally:
        acts.planned_attention_path = real
    return t.micro_batch_size * t.seq_len * (base + extra), mask


def measured_attention(cfg, path: str) -> int:
    """Distinct bytes autograd saves in one attend() call on CPU, fp32, forced onto ``path``'s tensors/kernel."""
    m, t = cfg.model, cfg.train
    b, s, hd = t.micro_batch_size, t.seq_len, m.head_dim
    q = torch.randn(b, m.num_heads, s, hd, requires_grad=True)
    k, v = (torch.randn(b, m.num_kv_heads, s, hd, requires_grad=True) for _ in range(2))
    doc_ids = (torch.arange(s) * 5 // s).expand(b, s)  # five documents a row
    mask = attn.additive_mask(block_causal_mask(doc_ids), torch.float32) if cfg.data.document_mask else None
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    real = attn.attention_path
    attn.attention_path = lambda *a: path
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
            sdpa_kernel(SDPBackend.MATH if path == attn.MATH else SDPBackend.FLASH_ATTENTION),
        ):
            out = attn.attend(q, k, v, mask)
    finally:
        attn.attention_path = real
    # the output: o_proj's input in the model, saved there (math) or by SDPA (fused); counted once either way
    storages[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(storages.values())


def row(cfg, path: str) -> str:
    """Planned MiB: per layer, the mask once per micro-batch, and a 32-layer stage (as llama-3.1-8b's)."""
    layer, mask = planned_attention(cfg, path)
    return f"{layer / MiB:9.1f} {mask / MiB:6.1f} {(32 * layer + mask) / GiB:9.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama-3.1-8b.yaml")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--measure-seq", type=int, default=512)
    a = p.parse_args()
    planned_table(a)
    measured_table(a)


def planned_table(a: argparse.Namespace) -> None:
    """Every device, dtype and mask: the attention path the planner picks and its MiB, beside the math kernel's."""
    base = ["--config", a.config, "--train.micro_batch_size", str(a.micro_batch)]
    m = load(base).model
    print(
        f"{a.config}: {m.num_heads} heads, {m.num_kv_heads} kv heads, head_dim {m.head_dim}; "
        f"micro-batch {a.micro_batch}, seq {a.seq}; one layer's attention, MiB saved for backward (planned)"
    )
    print(f"{'':39} {'-------- this path --------':>26}  {'-- math kernel (before) --':>26}")
    print(
        f"{'device':6} {'dtype':5} {'mask':5} {'path':20} {'layer':>9} {'mask':>6} {'32 (GiB)':>9}  "
        f"{'layer':>9} {'mask':>6} {'32 (GiB)':>9}"
    )
    for backend, device in (("nccl", "cuda"), ("gloo", "cpu")):
        for dtype in ("fp32", "bf16"):
            for mask in (False, True):
                cfg = with_layout(
                    load(
                        base
                        + [
                            "--train.seq_len",
                            str(a.seq),
                            "--parallel.backend",
                            backend,
                            "--data.document_mask",
                            str(mask).lower(),
                        ]
                    ),
                    dtype=dtype,
                )
                path = acts.planned_attention_path(cfg)
                print(f"{device:6} {dtype:5} {str(mask):5} {path:20} {row(cfg, path)}  {row(cfg, attn.MATH)}")


def measured_table(a: argparse.Namespace) -> None:
    """CPU fp32, micro-batch 1: one attend() call forced onto each path, measured beside planned."""
    print(f"\nCPU fp32, micro-batch 1, seq {a.measure_seq}: one attend() call forced onto each path, MiB")
    print(f"{'mask':5} {'path':20} {'measured':>9} {'planned':>9}")
    for mask in (False, True):
        cfg = with_layout(
            load(
                [
                    "--config",
                    a.config,
                    "--train.micro_batch_size",
                    "1",
                    "--train.seq_len",
                    str(a.measure_seq),
                    "--parallel.backend",
                    "gloo",
                    "--data.document_mask",
                    str(mask).lower(),
                ]
            ),
            dtype="fp32",
        )
        for path in (attn.CPU_FLASH, attn.EFFICIENT_REPEAT_KV, attn.MATH):
            print(
                f"{str(mask):5} {path:20} {measured_attention(cfg, path) / MiB:9.2f} "
                f"{sum(planned_attention(cfg, path)) / MiB:9.2f}"
            )


if __name__ == "__main__":
    main()
