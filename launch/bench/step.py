"""Benchmark: the engine's training step against a plain PyTorch/transformers loop on the same shapes, side by side.

    python launch/bench/step.py --config configs/llama-3.2-1b.yaml [--set train.seq_len=4096 ...] [--steps 20]
        [--warmup 3] [--side both|ours|plain] [--json]

Each side runs in its own process (``--side both``, the default, starts one per side), so neither inherits the
other's allocator state, compiled graphs or threads. ``ours``: the engine's Trainer (tp = pp = dp = 1) as the config
sets it. ``plain``: ``transformers.LlamaForCausalLM`` with the same shapes trained the way a careful user would
write it: bf16 autocast when train.dtype is bf16, ``torch.compile`` when train.compile, full activation
checkpointing (HF's) when train.activation_checkpointing is not none, AdamW as the engine picks it (fused on CUDA
and CPU), the same micro-batching, clipping and random batches, created on the device. Every step is timed between
``torch.cuda.synchronize()`` calls on CUDA (kernels run asynchronously); the figures are medians after ``--warmup``
steps (compilation happens there). MFU uses the model FLOPs of engine/model/flops.py (PaLM's 6N + 12 L H Q T)
for both sides and the device's peak from its table; none on CPU (unless log.peak_tflops gives one).
``efficiency``: the FLOP/s the device executed (recomputation included) over that peak, on one device with no
communication: what `launch/plan.py --efficiency-from` reads from the ``--json-out`` file of ``--side ours``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.config import load  # noqa: E402
from engine.model.flops import device_peak_tflops, flops_per_token, hardware_flops_per_token  # noqa: E402
from engine.optim import adamw_implementation  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_model(cfg, device: torch.device):
    """transformers' Llama with the config's shapes (the weights' values do not matter for speed)."""
    import transformers

    m = cfg.model
    config = transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=max(m.max_seq_len, cfg.train.seq_len),
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(device)
    if cfg.train.activation_checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


class PlainLoop:
    """What a user writes by hand: gradient accumulation over micro-batches under autocast, clip, AdamW step."""

    def __init__(self, cfg, device: torch.device):
        t = cfg.train
        self.cfg, self.device = cfg, device
        self.model = hf_model(cfg, device)
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            params,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
            **adamw_implementation(params),
        )
        self.forward = torch.compile(self.model) if t.compile else self.model

    def train_step(self, batch: torch.Tensor) -> float:
        t = self.cfg.train
        n = batch.shape[0] // t.micro_batch_size
        total = torch.zeros((), device=self.device)
        for micro in batch.split(t.micro_batch_size):  # (mbs, s+1)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.dtype == "bf16"):
                logits = self.forward(input_ids=micro[:, :-1]).logits  # (mbs, s, vocab)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), micro[:, 1:].reshape(-1)) / n
            loss.backward()
            total += loss.detach()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()


def engine_side(cfg):
    """The engine's Trainer on one rank; returns (train_step, device, parameter count)."""
    from engine.model.transformer import count_params
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    return trainer.train_step, trainer.ctx.device, count_params(trainer.model)


def run_side(side: str, argv: list[str], steps: int, warmup: int) -> dict:
    """Time ``steps`` optimizer steps of one side after ``warmup`` untimed ones; returns medians and rates."""
    cfg = load(argv)
    if side == "ours":
        step, device, params = engine_side(cfg)
    else:
        from engine.parallel.layout.context import pick_device_and_backend

        device, _ = pick_device_and_backend(cfg.parallel.backend)
        plain = PlainLoop(cfg, device)
        step, params = plain.train_step, sum(p.numel() for p in plain.model.parameters())
    t = cfg.train
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        batch = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=gen)
        batch = batch.to(device)  # both sides get the batch on the device, copied before the clock starts
        sync(device)
        start = time.perf_counter()
        step(batch)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens_per_s = t.global_batch_size * t.seq_len / seconds
    peak = device_peak_tflops(device, t.dtype, cfg.log.peak_tflops)
    tflops = tokens_per_s * flops_per_token(cfg.model, t.seq_len) / 1e12
    # what the device executed (recomputation included) over its peak: launch/plan.py --efficiency-from reads it
    executed = tokens_per_s * hardware_flops_per_token(cfg.model, t.seq_len, t.activation_checkpointing) / 1e12
    return {
        "side": side,
        "device": str(device),
        "params_M": params / 1e6,
        "ms": 1000 * seconds,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "efficiency": executed / peak if peak else None,
        "max_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


def config_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config, "--log.progress", "false", "--train.out_dir", args.out_dir]
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"error: --set {item!r} is not SECTION.KEY=VALUE")
        argv += [f"--{key}", value]
    return argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config YAML")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--side", choices=("both", "ours", "plain"), default="both")
    parser.add_argument("--json", action="store_true", help="print each side's figures as one JSON line")
    parser.add_argument("--out-dir", default="/tmp/engine-bench-step")
    parser.add_argument("--json-out", help="with --side ours|plain: write the figures to this JSON file too")
    args = parser.parse_args()
    os.environ.pop("MASTER_ADDR", None)
    if args.side != "both":
        result = run_side(args.side, config_argv(args), args.steps, args.warmup)
        print(json.dumps(result) if args.json else result, flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result))
        return
    rows = {}
    for side in ("ours", "plain"):  # one process each: a fresh allocator, compiler cache and thread pool
        cmd = [
            sys.executable,
            __file__,
            "--config",
            args.config,
            *[a for s in args.set for a in ("--set", s)],
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--out-dir",
            args.out_dir,
            "--side",
            side,
            "--json",
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[side] = json.loads(out.strip().splitlines()[-1])
    ours, plain = rows["ours"], rows["plain"]
    print(
        json.dumps({"ours": ours, "plain": plain, "ratio": ours["tokens_per_s"] / plain["tokens_per_s"]})
        if args.json
        else f"{args.config} {' '.join(args.set)} on {ours['device']}, median of {args.steps} steps\n"
        f"{'side':<8}{'params':>9}{'ms':>10}{'tok/s':>12}{'TFLOP/s':>9}{'MFU':>7}\n"
        + "\n".join(
            f"{r['side']:<8}{r['params_M']:>8.1f}M{r['ms']:>10.1f}{r['tokens_per_s']:>12.0f}"
            f"{r['tflops']:>9.2f}{'' if r['mfu'] is None else format(r['mfu'], '.1%'):>7}"
            for r in (ours, plain)
        )
        + f"\nours/plain tokens/s: {ours['tokens_per_s'] / plain['tokens_per_s']:.3f}"
    )


if __name__ == "__main__":
    main()
