"""Training data: tokenizers, raw files, packing and the global batch order (blending, indexed datasets and the
validation split are in engine/data/blend.py).

A dataset is a token stream: every document's ids, each followed by EOS. Packed sample ``i`` is the window
``tokens[i*s : i*s + s + 1]`` (inputs ``[:-1]``, labels ``[1:]``). :class:`TrainData` holds several datasets (indexed
PREFIX.bin/.idx from ``launch/preprocess.py`` or raw files tokenized on the fly), blends them by weight, and holds
each one's tail out for validation. :class:`GlobalBatchSampler` fixes one global order of sample ids that depends
only on the seed, so any data-parallel layout sees the same global batches, and a resume (even with another dp
size) continues with the next samples. ``transformers`` and ``datasets`` are imported lazily; megatron-core is not
needed here (its format is read with numpy).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import numbers
import pathlib
import tempfile
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
BUNDLED_CORPUS = ASSETS / "corpus.txt"
BUNDLED_TOKENIZER = ASSETS / "tokenizer"
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # suffix -> datasets builder

_BUNDLED_TOKENS: dict[tuple[str, int], np.ndarray] = {}  # (tokenizer name_or_path, len) -> bundled corpus ids


class DataError(ValueError):
    """A bad data input; ``str(e)`` is one line naming the file/value and what is valid."""


def load_tokenizer(name_or_path: str = "") -> PreTrainedTokenizerBase:
    """'' -> the bundled tokenizer. Otherwise ``AutoTokenizer.from_pretrained(name_or_path)`` (a local folder, or a
    hub name when online). A missing local path -> DataError naming it."""
    from transformers import AutoTokenizer

    target = name_or_path or str(BUNDLED_TOKENIZER)
    local = pathlib.Path(target).expanduser()
    looks_local = target.startswith(("/", ".", "~")) or local.exists()
    if looks_local and not local.is_dir():
        problem = "is not a folder" if local.exists() else "does not exist"
        raise DataError(
            f"tokenizer {name_or_path!r} {problem}; give a folder with tokenizer.json, "
            f"a Hugging Face hub name, or '' for the bundled tokenizer"
        )
    try:  # never the folder's own Python: transformers would ask on stdin, and a "y" there would run it
        return AutoTokenizer.from_pretrained(str(local) if looks_local else target, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  OSError, ValueError; the tokenizers library's bare Exception on a
        # damaged tokenizer.json ("EOF while parsing a value at line 178 column 11")
        if "trust_remote_code" in str(e):
            raise DataError(
                f"tokenizer {target!r} needs trust_remote_code (its config's auto_map names Python code "
                f"of its own), which the engine never runs; give a tokenizer that loads without it "
                f"(tokenizer.json), or '' for the bundled tokenizer"
            ) from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if type(e) is Exception and looks_local:  # the tokenizers library's parse of the folder's tokenizer.json
            reason = f"{local / 'tokenizer.json'}: {reason}"
        raise DataError(
            f"could not load tokenizer {target!r} ({reason}); give a folder with tokenizer.json, "
            f"a hub name (online), or '' for the bundled tokenizer"
        ) from e


@contextlib.contextmanager
def quiet_datasets() -> Iterator[str]:
    """Yield a throw-away datasets cache folder with progress bars off (so nothing lands in ~/.cache)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="engine-data-") as cache_dir:
            yield cache_dir
    finally:
        if bars:
            datasets.enable_progress_bars()


def open_documents(path: pathlib.Path, text_key: str, cache_dir: str):
    """Open one local file with ``datasets.load_dataset`` -> (datasets.Dataset, text column). A whole .txt file is
    one document; .json/.jsonl/.parquet give one document per record (field ``text_key``). A missing, empty or
    unreadable file, or a missing/non-string field -> DataError naming the file (shared with launch/preprocess.py)."""
    import datasets

    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(BUILDERS)}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: no text (the file is empty)")
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log line would repeat ours, apart
    try:
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", cache_dir=cache_dir, **kwargs)
    except Exception as e:  # datasets/pyarrow raise many types (e.g. StopIteration, ArrowInvalid)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else f"{type(e).__name__}, is it empty?"
        where = _bad_json_line(path) if builder == "json" else None
        raise DataError(f"{path}: could not read it as {builder} ({where or reason})") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    column = "text" if builder == "text" else text_key
    check_text_column(ds, column, str(path))
    return ds, column


def _bad_json_line(path: pathlib.Path) -> str | None:
    """For a JSON Lines file that failed to load: the first line that is not a JSON value, and why (datasets only
    logs pyarrow's 0-based row within a read block). None when every line parses (a .json array, say)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                json.loads(line.strip() or b"null")
            except json.JSONDecodeError as e:
                return f"line {number} is not valid JSON: {e.msg} at column {e.colno}"
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 (byte {e.start + 1} of the line)"
    return None


def check_text_column(ds, column: str, name: str) -> None:
    """DataError naming ``name`` unless ``ds`` (a datasets.Dataset) has a string (or all-null) field ``column``."""
    if column not in ds.column_names:
        raise DataError(
            f"{name}: no field {column!r}; its fields are {ds.column_names} (set data.text_key, or "
            f"--text-key in launch/preprocess.py, to the one holding the text)"
        )
    if getattr(ds.features[column], "dtype", None) not in ("string", "large_string", "null"):
        raise DataError(f"{name}: field {column!r} must hold strings, it holds {ds.features[column]}")


def _read_documents(path: pathlib.Path, text_key: str, cache_dir: str) -> list[str]:
    """The non-empty documents of one file (see open_documents); none -> DataError naming the file."""
    ds, column = open_documents(path, text_key, cache_dir)
    docs = [d for d in ds[column] if d]
    if not docs:
        raise DataError(f"{path}: no text (the file or its {column!r} field is empty)")
    return docs


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that ends every document, or DataError naming a tokenizer that has none."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token; use one that defines it")
    return tokenizer.eos_token_id


def encode_documents(docs: list[str], tokenizer: PreTrainedTokenizerBase) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize each document alone (no special tokens) and join them as doc0 EOS doc1 EOS ... -> the ids
    (n_tokens,) int32 and each document's length with its EOS (n_docs,) int64. The one place that turns text into
    training tokens (the bundled/raw-file path here, launch/preprocess.py's workers)."""
    eos = eos_id(tokenizer)
    ids = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"] if docs else []  # list of lists
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    stream = itertools.chain.from_iterable(itertools.chain(x, (eos,)) for x in ids)
    return np.fromiter(stream, dtype=np.int32, count=int(lengths.sum())), lengths


def documents_to_ids(docs: list[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Tokenize documents (no special tokens) and join them as doc0 EOS doc1 EOS ... -> (n_tokens,) int32."""
    return encode_documents(docs, tokenizer)[0]


def tokenize_files(paths: list[str], tokenizer: PreTrainedTokenizerBase, text_key: str = "text") -> np.ndarray:
    """Read files with ``datasets.load_dataset`` (.txt -> 'text' with sample_by='document', one document per file;
    .json/.jsonl -> 'json'; .parquet -> 'parquet', field ``text_key``), tokenize each document without special
    tokens, append EOS after each, concatenate -> 1-D int32 array. Empty documents are skipped. A missing file, an
    empty result or a missing ``text_key`` -> DataError naming the file. Local files never touch the hub, and the
    datasets cache lives in a temporary folder that is removed afterwards."""
    if not paths:
        raise DataError("no data files given; pass .txt, .json, .jsonl or .parquet files")
    parts = []
    with quiet_datasets() as cache_dir:
        for p in paths:
            docs = _read_documents(pathlib.Path(p).expanduser(), text_key, cache_dir)
            parts.append(documents_to_ids(docs, tokenizer))
    return np.concatenate(parts)


def load_train_tokens(paths: list[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """paths empty -> the bundled corpus tokenized as one document (cached in-process per tokenizer, read-only);
    otherwise ``tokenize_files(paths, tokenizer)``."""
    if paths:
        return tokenize_files(list(paths), tokenizer)
    key = (str(tokenizer.name_or_path), len(tokenizer))
    if key not in _BUNDLED_TOKENS:
        tokens = documents_to_ids([BUNDLED_CORPUS.read_text(encoding="utf-8")], tokenizer)
        tokens.flags.writeable = False
        _BUNDLED_TOKENS[key] = tokens
    return _BUNDLED_TOKENS[key]


class PackedDataset:
    """Fixed-length samples from a token stream: sample i = tokens[i*seq_len : i*seq_len + seq_len + 1]
    (seq_len+1 tokens: inputs are [:-1], labels [1:]); consecutive samples share one boundary token.
    ``len`` = (len(tokens) - 1) // seq_len; ``ds[i]`` -> LongTensor (seq_len+1,)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len}; it must be a positive number of tokens")
        self.tokens = np.asarray(tokens).reshape(-1)  # (n_tokens,)
        self.seq_len = seq_len
        if len(self) < 1:
            raise DataError(
                f"the data has {len(self.tokens)} tokens; one sample of seq_len={seq_len} needs "
                f"{seq_len + 1}; add data or lower train.seq_len"
            )

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))  # (s+1,)


def check_consumed(consumed) -> int:
    """A data position (global samples consumed) as an int, or DataError naming the bad value."""
    if isinstance(consumed, bool) or not isinstance(consumed, numbers.Integral) or consumed < 0:
        raise DataError(f"consumed_samples={consumed!r} is not a data position; expected an int >= 0")
    return int(consumed)


class GlobalBatchSampler:
    """Deterministic global sample order: epoch e is ``numpy.random.default_rng(seed + e).permutation(num_samples)``
    and the stream of global sample ids is epoch 0, epoch 1, ... It holds no position: ``batch(consumed)``
    returns dp rank r's contiguous slice [r*B/dp : (r+1)*B/dp] of the B = global_batch_size ids of the stream that
    follow the first ``consumed``. The caller keeps that one count (engine/data/feed.py BatchFeed), so a resume
    with another dp size continues with exactly the next samples (the idea of Megatron's
    MegatronPretrainingRandomSampler)."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if num_samples < 1:
            raise DataError(f"num_samples={num_samples}; the dataset must have at least one sample")
        if global_batch_size < 1 or dp_size < 1 or global_batch_size % dp_size:
            raise DataError(
                f"global_batch_size={global_batch_size} must be a positive multiple of the data-parallel "
                f"size dp={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, {dp_size})")
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._perms: dict[int, np.ndarray] = {}  # epoch -> (num_samples,) permutation; at most two kept

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        return self._perms[epoch]

    def batch(self, consumed: int) -> list[int]:
        """This dp rank's B/dp sample ids of the global batch after ``consumed`` samples of the stream."""
        local = self.global_batch_size // self.dp_size
        first = check_consumed(consumed) + self.dp_rank * local
        return [int(self._epoch(p // self.num_samples)[p % self.num_samples]) for p in range(first, first + local)]


def collate(dataset: PackedDataset, ids: list[int]) -> torch.Tensor:
    """Stack samples -> (len(ids), seq_len+1) LongTensor."""
    if not ids:
        return torch.empty((0, dataset.seq_len + 1), dtype=torch.long)
    return torch.stack([dataset[i] for i in ids])
