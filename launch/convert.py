"""Convert between engine checkpoints and Hugging Face Llama, Qwen2 and Mistral folders (engine/hf/convert.py).

    python launch/convert.py export CKPT OUT_DIR [--max-shard-size 5GB] [--dtype fp32|bf16|fp16] [--overwrite]
    python launch/convert.py import HF_DIR CKPT [--overwrite]

``export``: CKPT is a ``step_*`` directory or a checkpoint directory with ``latest``, saved at any layout; OUT_DIR
loads with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. ``import``: writes the
model-only checkpoint ``CKPT/step_000000`` and ``CKPT/config.yaml``; start a run from it at any layout with
``python launch/pretrain.py --config CKPT/config.yaml [--parallel.tp 2 ...]`` (step 0, fresh optimizer).
Both write a temporary folder beside OUT_DIR / CKPT and rename it into place; a non-empty OUT_DIR / CKPT is
refused unless ``--overwrite`` is given, which replaces it as a whole (nothing of the old folder is kept), and
only if an earlier export / import wrote it and it holds nothing else (engine/checkpoint/folder.py: never a
checkpoint, a run's out_dir, the source, ``.`` or ``/``).
Bad input exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from safetensors import SafetensorError  # noqa: E402  (a write that fails inside safetensors: disk full)

from engine.checkpoint.format import CheckpointError  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from engine.data.dataset import DataError  # noqa: E402

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (decimal units as transformers' max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="checkpoint -> Hugging Face folder")
    e.add_argument("ckpt", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--max-shard-size", type=parse_size, default="5GB", help="split weights above this (5GB)")
    e.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    e.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR as a whole")
    i = sub.add_parser("import", help="Hugging Face folder -> model-only checkpoint")
    i.add_argument("hf_dir", type=Path)
    i.add_argument("ckpt", type=Path)
    i.add_argument("--overwrite", action="store_true", help="replace an earlier import in CKPT as a whole")
    return p


def main(argv: list[str]) -> int:
    from engine.hf import convert as hf

    args = parser().parse_args(argv)  # argparse itself exits 2 with "error: ..." on bad arguments
    if args.command == "export":
        info = hf.export(args.ckpt, args.out, args.max_shard_size, args.dtype, args.overwrite)
        print(f"exported step {info['step']} ({info['params']} tensors, {len(info['files'])} file(s)) to {args.out}")
    else:
        path = hf.import_hf(args.hf_dir, args.ckpt, overwrite=args.overwrite)
        print(
            f"imported {args.hf_dir} as {path}; train from it with: python launch/pretrain.py "
            f"--config {args.ckpt / 'config.yaml'} [--checkpoint.dir DIR ...]"
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (CheckpointError, ConfigError, DataError, OSError, SafetensorError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
