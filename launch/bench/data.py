"""Data-pipeline benchmark (not a test): preprocessing throughput and the cost of one global batch.

    python launch/bench/data.py [--mb 4] [--workers 1 2] [--out /tmp/engine-bench-data]

1. Generates a jsonl corpus of about ``--mb`` MB (documents of 20-400 words drawn from the bundled corpus), then
   runs launch/preprocess.py's ``preprocess`` on it with each ``--workers`` count: tokens/s of the tokenize+write
   phase (process start-up and the megatron-core import are not counted; they are printed apart).
2. Builds TrainData from the written prefix (tiny config: seq_len 128, global batch 16) and times one global batch,
   ``batch_from(data, sampler.batch(consumed))``, against the tiny model's ~600 ms step on 2 cores.
3. For comparison, the start-up cost of the same corpus as a raw file (tokenized on the fly by TrainData).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.data import blend  # noqa: E402
from engine.data import dataset as data  # noqa: E402

TINY_STEP_S = 0.600  # the tiny config's step time on 2 CPU cores (launch/bench/step.py)


def make_corpus(path: pathlib.Path, megabytes: float, seed: int = 0) -> int:
    """Write a jsonl of about ``megabytes`` MB; returns the number of documents."""
    rng = np.random.default_rng(seed)
    words = np.array(data.BUNDLED_CORPUS.read_text(encoding="utf-8").split())
    n_docs, size = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(20, 400))))}) + "\n"
            f.write(line)
            size += len(line.encode())
            n_docs += 1
    return n_docs


def load_preprocess():
    """launch/preprocess.py as a module."""
    spec = importlib.util.spec_from_file_location("preprocess", ROOT / "launch" / "preprocess.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess"] = module  # worker processes find _encode by its module name
    spec.loader.exec_module(module)
    return module


def bench_batches(prefix: str, seq_len: int, gbs: int, n: int) -> tuple[float, float, str]:
    """(TrainData build seconds, median seconds per global batch, describe line)."""
    tok = data.load_tokenizer("")
    start = time.perf_counter()
    td = blend.TrainData(blend.DataSpec([prefix], [], seq_len, seed=1234, vocab_size=len(tok)), tok)
    build = time.perf_counter() - start
    sampler = data.GlobalBatchSampler(td.num_train_samples, gbs, seed=1234)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        batch = blend.batch_from(td, sampler.batch(i * gbs))
        times.append(time.perf_counter() - t0)
    assert batch.shape == (gbs, seq_len + 1)
    return build, statistics.median(times), td.describe()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="runs per worker count; the best is reported")
    parser.add_argument("--out", default="/tmp/engine-bench-data")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    n_docs = make_corpus(corpus, args.mb)
    print(f"corpus: {corpus} {corpus.stat().st_size / 1e6:.1f} MB, {n_docs} documents")
    t0 = time.perf_counter()
    pre = load_preprocess()
    pre._builder_class()
    print(f"import launch/preprocess.py + megatron-core: {time.perf_counter() - t0:.1f} s (not counted below)")
    for workers in args.workers:
        best = max(
            (pre.preprocess([str(corpus)], str(out / "corpus"), workers=workers) for _ in range(args.repeats)),
            key=lambda s: s["tokens_per_s"],
        )
        print(
            f"preprocess --workers {workers}: {best['tokens']} tokens in {best['seconds']:.2f} s = "
            f"{best['tokens_per_s']:,.0f} tokens/s"
        )
    build, per_batch, line = bench_batches(str(out / "corpus"), seq_len=128, gbs=16, n=500)
    print(line)
    print(
        f"TrainData from the prefix: {build * 1e3:.0f} ms to build; one global batch (16 x 129): "
        f"{per_batch * 1e3:.3f} ms = {per_batch / TINY_STEP_S:.3%} of a {TINY_STEP_S * 1e3:.0f} ms tiny step"
    )
    t0 = time.perf_counter()
    td = blend.TrainData(blend.DataSpec([str(corpus)], [], 128, 1234, 4096), data.load_tokenizer(""))
    print(
        f"the same corpus as a raw .jsonl (tokenized on the fly at start-up): {time.perf_counter() - t0:.2f} s, "
        f"{td.num_train_samples} train samples"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
