"""Datasets for training: Megatron indexed datasets (read with numpy), blending by weight, the validation split.

:class:`TrainData` holds several datasets (indexed PREFIX.bin/.idx written by ``launch/preprocess.py`` or raw files
tokenized on the fly), blends them by weight (the idea of Megatron's BlendedDataset: a deterministic per-sample
dataset index whose running fractions track the weights), and holds each one's tail out for validation. Sample ids
are positions in the blend; engine.data.dataset.GlobalBatchSampler orders them.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from engine.data.dataset import BUILDERS, DataError, PackedDataset, load_train_tokens, tokenize_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron .idx: header, <Q version 1, <B dtype code, <Q n_seq, <Q n_doc, arrays
INDEX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # 6, 7: floats


def read_indexed(prefix: str) -> np.ndarray:
    """The token stream of Megatron's indexed dataset PREFIX.bin + PREFIX.idx (megatron-core's
    IndexedDatasetBuilder, launch/preprocess.py): all sequences in file order, as a read-only memory map in the
    stored dtype. Read here with numpy (megatron-core is not needed to train). The .idx must be well formed and
    describe exactly the bytes of the .bin; a missing, truncated, mismatched, empty or unreadable pair -> DataError
    naming it."""
    try:
        return _read_indexed(prefix)
    except OSError as e:  # permission denied, an I/O error: was a traceback (issue 42)
        raise DataError(f"{e.filename or prefix}: cannot be read ({e.strerror or e})") from None


def _read_indexed(prefix: str) -> np.ndarray:
    idx, bin_ = pathlib.Path(prefix + ".idx"), pathlib.Path(prefix + ".bin")
    for path, other in ((idx, bin_), (bin_, idx)):
        if not path.is_file():
            raise DataError(
                f"{path}: no such file ({other.name} is {'there' if other.is_file() else 'missing too'}); "
                f"launch/preprocess.py writes both, the .idx last: rerun it"
            )
    with open(idx, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != INDEX_HEADER:
        raise DataError(f"{idx}: not a Megatron indexed-dataset index (bad header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in INDEX_DTYPES:
        raise DataError(
            f"{idx}: unsupported index (version {version}, dtype code {code}); "
            f"expected version 1 with integer token ids"
        )
    if idx.stat().st_size < 34 + 12 * n_seq + 8 * n_doc:
        raise DataError(f"{idx}: truncated ({idx.stat().st_size} bytes for {n_seq} sequences, {n_doc} documents)")
    dtype = np.dtype(INDEX_DTYPES[code])
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(n_seq,)) if n_seq else np.zeros(0)
    n_tokens = int(lengths.sum(dtype=np.int64))
    if bin_.stat().st_size != n_tokens * dtype.itemsize:
        raise DataError(
            f"{bin_}: {bin_.stat().st_size} bytes, but {idx.name} describes {n_tokens} tokens of "
            f"{dtype.name} ({n_tokens * dtype.itemsize} bytes); the pair is mismatched or truncated"
        )
    if n_tokens == 0:
        raise DataError(f"{prefix}: no tokens (the indexed dataset is empty)")
    return np.memmap(bin_, dtype=dtype, mode="r")


def _open_source(
    path: str, tokenizer: PreTrainedTokenizerBase, text_key: str
) -> tuple[str, np.ndarray, tuple[int, int]]:
    """One data.paths entry -> (kind, token stream, (min, max) token id). An indexed-dataset prefix (PREFIX.bin/.idx
    exist; a trailing .bin/.idx is dropped) is memory-mapped, its range scanned once (indexed_range); a
    .txt/.json/.jsonl/.parquet file is tokenized now (tokenize_files) and scanned here."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    prefix = str(pathlib.Path(prefix).expanduser())
    if os.path.exists(prefix + ".bin") or os.path.exists(prefix + ".idx"):
        tokens = read_indexed(prefix)
        return f"indexed {tokens.dtype.name}", tokens, indexed_range(prefix, tokens)
    if pathlib.Path(path).suffix.lower() in BUILDERS:
        tokens = tokenize_files([path], tokenizer, text_key)
        return "raw", tokens, scan_range(tokens)
    raise DataError(
        f"data path {path!r}: found neither {prefix}.bin/.idx (an indexed dataset from "
        f"launch/preprocess.py) nor a raw {'/'.join(BUILDERS)} file"
    )


SCAN_CHUNK = 1 << 26  # tokens per slice of a range scan: bounded memory on a corpus of terabytes


def scan_range(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) token id of a stream: one pass over it, a slice at a time (an empty stream: (0, -1))."""
    lo, hi = 0, -1
    for start in range(0, len(tokens), SCAN_CHUNK):
        part = tokens[start : start + SCAN_CHUNK]
        low = 0 if tokens.dtype.kind == "u" else int(part.min())
        lo, hi = (low, int(part.max())) if start == 0 else (min(lo, low), max(hi, int(part.max())))
    return lo, hi


def _range_key(prefix: str) -> dict:
    """What identifies one version of an indexed dataset: the .bin's and .idx's sizes and modification times."""
    stats = {ext: os.stat(prefix + ext) for ext in (".bin", ".idx")}
    return {f"{ext[1:]}_{k}": getattr(st, f"st_{k}") for ext, st in stats.items() for k in ("size", "mtime_ns")}


def _cached_range(path: pathlib.Path, key: dict) -> tuple[int, int] | None:
    try:
        saved = json.loads(path.read_text())
        return (int(saved["min"]), int(saved["max"])) if saved.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def indexed_range(prefix: str, tokens: np.ndarray) -> tuple[int, int]:
    """The token-id range of indexed dataset ``prefix``, scanned once per version of its files, not once per reader
    or per job: the result is kept beside the index in PREFIX.range.json, keyed on the .bin's and .idx's sizes and
    modification times. The first reader holds a lock on the .idx while it scans; the others wait for its result
    (an flock: across hosts on NFS v4; a file system without flock, or a folder not writable, only costs rescans)."""
    path, key = pathlib.Path(prefix + ".range.json"), _range_key(prefix)
    found = _cached_range(path, key)
    if found is not None:
        return found
    with open(prefix + ".idx", "rb") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass  # no locks here: every reader scans, as without the cache
        found = _cached_range(path, key)
        if found is not None:
            return found
        found = scan_range(tokens)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"key": key, "dtype": tokens.dtype.name, "min": found[0], "max": found[1]}))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only folder: the next reader scans again
    return found


def _check_vocab(name: str, span: tuple[int, int], vocab_size: int) -> None:
    """DataError naming the dataset unless every token id, in ``span`` = (min, max), is in [0, vocab_size)."""
    lo, hi = span
    if lo < 0 or hi >= vocab_size:
        raise DataError(
            f"dataset {name}: token ids span [{lo}, {hi}] (max id {hi}) but the model's vocab_size is "
            f"{vocab_size}; tokenize it with the model's tokenizer or raise model.vocab_size"
        )


def _split(name: str, tokens: np.ndarray, seq_len: int, valid_fraction: float) -> tuple[PackedDataset, list]:
    """(train, [valid] or []) packed datasets of one token stream. Of its n = (T-1)//seq_len samples,
    n_valid = max(1, round(valid_fraction * n)) (0 when valid_fraction is 0) come from its end: the last
    n_valid*seq_len + 1 tokens, no token shared with training; n_valid is lowered so >= 1 training sample stays,
    so a stream of fewer than 2*seq_len + 2 tokens gives no validation sample."""
    s, total = seq_len, len(tokens)
    if total < s + 1:
        raise DataError(
            f"dataset {name}: {total} tokens; one sample of seq_len={s} needs {s + 1}; add data or lower train.seq_len"
        )
    n = (total - 1) // s
    n_valid = 0 if valid_fraction == 0 else min(max(1, math.floor(valid_fraction * n + 0.5)), (total - s - 2) // s)
    if n_valid <= 0:
        return PackedDataset(tokens, s), []
    cut = total - n_valid * s - 1
    return PackedDataset(tokens[:cut], s), [PackedDataset(tokens[cut:], s)]


def blend_counts(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer per-dataset sample counts summing to ``total``, each within 1 of weights*total (largest remainder;
    ties to the lower dataset index). ``weights`` must be normalised."""
    raw = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(raw).astype(np.int64)
    counts[np.argsort(-(raw - counts), kind="stable")[: max(0, total - int(counts.sum()))]] += 1
    return counts


def blend_order(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interleave datasets: slot k of dataset d gets the key (k + 0.5) / counts[d] and slots are sorted by key
    (stable, so ties go to the lower d) -> (dataset_index int16, slot int64), both of length sum(counts). Every
    prefix of length i then holds within (1 + n_datasets)/2 samples of counts[d]/sum(counts) * i from dataset d:
    the realised fractions track the weights everywhere, as Megatron's greedy BlendedDataset index does."""
    counts = np.asarray(counts, dtype=np.int64)
    keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c] or [np.zeros(0)])
    order = np.argsort(keys, kind="stable")
    dataset = np.repeat(np.arange(len(counts), dtype=np.int16), counts)[order]
    slot = np.concatenate([np.arange(c) for c in counts] or [np.zeros(0, np.int64)])[order]
    return dataset, slot


@dataclass
class DataSpec:
    """What the trainer knows about its data. ``paths``: indexed-dataset prefixes (PREFIX.bin/PREFIX.idx) or raw
    .txt/.json/.jsonl/.parquet files, each one dataset; [] = the bundled corpus. ``weights``: one per path, any
    positive scale ([] = proportional to each dataset's training samples). ``vocab_size``: the model's; every token
    id must be below it. ``valid_fraction`` in [0, 1): the share of each dataset held out for validation."""

    paths: list[str]
    weights: list[float]
    seq_len: int
    seed: int
    vocab_size: int
    valid_fraction: float = 0.01
    text_key: str = "text"  # the text field of raw .json/.jsonl/.parquet files


def spec_from_config(cfg) -> DataSpec:
    """The DataSpec of an engine.config.Config: data.paths/weights/valid_fraction/text_key, train.seq_len/seed,
    model.vocab_size."""
    return DataSpec(
        list(cfg.data.paths),
        list(cfg.data.weights),
        cfg.train.seq_len,
        cfg.train.seed,
        cfg.model.vocab_size,
        cfg.data.valid_fraction,
        cfg.data.text_key,
    )


class TrainData:
    """Blended, packed, split training + validation data for one run.

    Each dataset is a token stream (documents each followed by EOS) cut into packed samples of seq_len + 1 tokens,
    sample i starting at token i*seq_len, so a document longer than seq_len continues in the next samples. Its tail
    is held out for validation (``_split``). The blend has ``num_train_samples`` = the sum of the datasets' training
    samples; dataset d fills ``blend_counts(weights)[d]`` of them, interleaved by ``blend_order``, taking its samples
    in seeded random orders, one fresh order per pass (an up-weighted dataset repeats, a down-weighted one gives a
    seeded subset). Global id g is slot g of that blend; the GlobalBatchSampler shuffles ids per epoch. Validation
    takes every held-out sample once, in dataset order interleaved by size."""

    def __init__(self, spec: DataSpec, tokenizer: PreTrainedTokenizerBase | None):
        """Open or tokenize every dataset (the tokenizer is only needed for raw files and the bundled corpus),
        check token ids against spec.vocab_size, split off validation, build the blend. Bad input -> DataError."""
        if spec.seq_len < 1 or not 0 <= spec.valid_fraction < 1:
            raise DataError(f"seq_len={spec.seq_len} must be >= 1 and valid_fraction={spec.valid_fraction} in [0, 1)")
        weights = list(spec.weights)
        if weights and (
            len(weights) != len(spec.paths)
            or not all(math.isfinite(w) and w >= 0 for w in weights)
            or sum(weights) <= 0
        ):
            raise DataError(
                f"data.weights={weights}: give one finite weight >= 0 per path "
                f"({len(spec.paths)} paths), not all zero, or none"
            )
        self.spec = spec
        self.names = list(spec.paths) or ["bundled corpus"]
        self.kinds, self.sizes, self.train, self.valid = [], [], [], []
        for name in self.names:
            if spec.paths:
                kind, tokens, span = _open_source(name, tokenizer, spec.text_key)
            else:
                kind, tokens = "raw", load_train_tokens([], tokenizer)
                span = scan_range(tokens)
            _check_vocab(name, span, spec.vocab_size)
            train, valid = _split(name, tokens, spec.seq_len, spec.valid_fraction)
            self.kinds.append(kind)
            self.sizes.append(len(tokens))
            self.train.append(train)
            self.valid.append(valid[0] if valid else None)
        n_train = np.array([len(t) for t in self.train], dtype=np.int64)
        w = np.asarray(weights or n_train, dtype=np.float64)
        self.weights = w / w.sum()
        self.counts = blend_counts(self.weights, int(n_train.sum()))
        self._dataset, slot = blend_order(self.counts)
        self._sample = np.empty(len(slot), dtype=np.int64)
        for d, (count, n) in enumerate(zip(self.counts, n_train)):
            passes = [np.random.default_rng([spec.seed, d, p]).permutation(n) for p in range(-(-count // n))]
            mine = self._dataset == d
            self._sample[mine] = np.concatenate(passes or [np.zeros(0, np.int64)])[slot[mine]]
        n_valid = np.array([len(v) if v is not None else 0 for v in self.valid], dtype=np.int64)
        self._valid_dataset, self._valid_sample = blend_order(n_valid)
        self.num_train_samples, self.num_valid_samples = len(self._sample), int(n_valid.sum())

    def locate(self, global_id: int) -> tuple[int, int]:
        """Global training id -> (dataset index, sample index within that dataset's training part)."""
        if not 0 <= global_id < self.num_train_samples:
            raise IndexError(f"training sample {global_id} out of range [0, {self.num_train_samples})")
        return int(self._dataset[global_id]), int(self._sample[global_id])

    def train_sample(self, global_id: int) -> torch.Tensor:
        """The global_id-th training sample of the blend -> (seq_len+1,) int64."""
        d, i = self.locate(global_id)
        return self.train[d][i]

    def valid_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Validation batches (batch_size, seq_len+1) int64, always in the same order: ceil(num_valid_samples /
        batch_size) batches (at most max_batches when given), the last one filled up from the start so every batch
        has the same shape; nothing when there are no validation samples."""
        if batch_size < 1:
            raise DataError(f"validation batch_size={batch_size} must be >= 1")
        n = self.num_valid_samples
        num = -(-n // batch_size) if max_batches is None else min(-(-n // batch_size), max(0, max_batches))

        def batches() -> Iterator[torch.Tensor]:
            for b in range(num):
                pos = [(b * batch_size + j) % n for j in range(batch_size)]
                yield torch.stack([self.valid[self._valid_dataset[p]][int(self._valid_sample[p])] for p in pos])

        return batches()

    def describe(self) -> str:
        """One line: each dataset with its kind, tokens, weight and sample counts; the totals."""
        parts = [
            f"{name} [{kind}, {size} tokens] weight {w:.3f}: {c} of {len(t)} train samples in the blend, "
            f"{len(v) if v is not None else 0} valid"
            for name, kind, size, w, c, t, v in zip(
                self.names, self.kinds, self.sizes, self.weights, self.counts, self.train, self.valid
            )
        ]
        return (
            f"data: {len(self.names)} dataset(s), seq_len {self.spec.seq_len}: "
            + "; ".join(parts)
            + f" | blend {self.num_train_samples} train samples per epoch, {self.num_valid_samples} valid"
        )


def batch_from(data: TrainData, ids: list[int]) -> torch.Tensor:
    """Stack training samples by global id -> (len(ids), seq_len+1) int64."""
    if not ids:
        return torch.empty((0, data.spec.seq_len + 1), dtype=torch.long)
    return torch.stack([data.train_sample(i) for i in ids])
