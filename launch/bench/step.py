"""Benchmark: the engine's training step against a plain PyTorch loop on the same shapes, side by side.

    python launch/bench/step.py --config configs/tiny.yaml --config configs/50m.yaml [--steps 20] [--warmup 3]

For each config, one process builds our Trainer (tp = pp = dp = 1) and a ``transformers.LlamaForCausalLM`` with
the same shapes and weights, trained by the loop a user would write (forward, cross-entropy, backward, clip,
AdamW step) with the same micro-batching. Steps of the two alternate (A B A B ...) on the same random global
batches, so drift in machine load hits both alike; the figures are medians, and the ratio is ours / plain.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.config import load  # noqa: E402
from engine.model.transformer import count_params  # noqa: E402
from engine.parallel.context import ParallelContext, destroy  # noqa: E402
from engine.trainer import Trainer  # noqa: E402


def hf_model(trainer: Trainer):
    """transformers' Llama with our shapes, loaded with our initial weights."""
    import transformers
    m = trainer.cfg.model
    config = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(trainer.ctx.device)
    model.load_state_dict(trainer.model.state_dict())
    return model.train()


def plain_step(model, optimizer, batch: torch.Tensor, micro_batch_size: int, clip: float) -> float:
    """What a user writes by hand: gradient accumulation over micro-batches, clip, AdamW step."""
    n = batch.shape[0] // micro_batch_size
    total = 0.0
    for micro in batch.split(micro_batch_size):
        logits = model(input_ids=micro[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), micro[:, 1:].reshape(-1)) / n
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def bench_config(path: str, steps: int, warmup: int) -> dict:
    cfg = load(["--config", path, "--log.progress", "false", "--train.out_dir", "/tmp/engine-bench"])
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    t = cfg.train
    plain = hf_model(trainer)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay)
    gen = torch.Generator().manual_seed(0)
    ours_s, plain_s = [], []
    for i in range(warmup + steps):
        batch = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=gen)
        start = time.perf_counter()
        trainer.train_step(batch)
        mid = time.perf_counter()
        plain_step(plain, plain_opt, batch, t.micro_batch_size, t.grad_clip)
        end = time.perf_counter()
        if i >= warmup:
            ours_s.append(mid - start)
            plain_s.append(end - mid)
    destroy()
    ours, base = statistics.median(ours_s), statistics.median(plain_s)
    return {"config": path, "params_M": count_params(trainer.model) / 1e6, "ours_ms": 1000 * ours,
            "plain_ms": 1000 * base, "ratio": ours / base,
            "tokens_per_s": t.global_batch_size * t.seq_len / ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="config YAML (repeatable)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.pop("MASTER_ADDR", None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} steps each")
    print(f"{'config':<24}{'params':>9}{'ours ms':>10}{'plain ms':>10}{'ours/plain':>12}{'tok/s':>10}")
    for path in args.config:
        r = bench_config(path, args.steps, args.warmup)
        print(f"{r['config']:<24}{r['params_M']:>8.1f}M{r['ours_ms']:>10.1f}{r['plain_ms']:>10.1f}"
              f"{r['ratio']:>12.3f}{r['tokens_per_s']:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
