"""Tokenize documents into Megatron's indexed dataset format: PREFIX.bin (token ids) + PREFIX.idx (the index).

    python launch/preprocess.py --input docs.jsonl more.parquet --output data/corpus [--tokenizer NAME_OR_PATH]
        [--workers N] [--text-key text] [--split train]

Each input is a local .json/.jsonl/.parquet file (one document per record, field ``--text-key``), a .txt file (one
document, as in engine/data/dataset.py) or a Hugging Face hub dataset name (its ``--split``), read with
``datasets.load_dataset``. Every non-empty document becomes one sequence (and one document in the index): its
token ids without special tokens, then EOS (Megatron's ``--append-eod``), in input order. ids are stored as uint16
when the vocabulary has fewer than 65500 tokens, else int32 (Megatron's ``DType.optimal_dtype``). The files are
written through megatron-core's ``IndexedDatasetBuilder`` under temporary names and renamed, the .idx last, so
Megatron-LM reads the output as is and ``--data.paths PREFIX`` trains on it. ``--workers`` processes tokenize in
parallel (the tokenizer's own threads are off, so N workers use N cores). Bad input exits with status 2 and one
line ``error: ...`` naming the file.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import pathlib
import sys
import time
import warnings
from typing import Iterator

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # --workers is the parallelism; rayon threads must not cross fork()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from engine.data import dataset as data  # noqa: E402
from engine.data.dataset import DataError  # noqa: E402

_STATE: dict = {}  # set before the worker processes fork: "tokenizer" and "inputs" [(datasets.Dataset, column)]


def index_dtype(vocab_size: int) -> type:
    """The .bin dtype for a vocabulary, as Megatron chooses it: uint16 below 65500 tokens, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def open_input(spec: str, text_key: str, split: str, cache_dir: str):
    """One --input -> (datasets.Dataset, text column). Something that exists, has a data-file suffix or looks like
    a path is a local file (engine.data.dataset.open_documents checks it); anything else is a hub dataset name."""
    import datasets

    path = pathlib.Path(spec).expanduser()
    if path.exists() or path.suffix.lower() in data.BUILDERS or spec.startswith(("/", ".", "~")):
        return data.open_documents(path, text_key, cache_dir)
    try:
        ds = datasets.load_dataset(spec, split=split)
    except Exception as e:  # offline, unknown name, bad split: many exception types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{spec}: not a local file, and loading it from the Hugging Face hub failed ({reason})") from e
    data.check_text_column(ds, text_key, spec)
    return ds, text_key


def check_has_text(ds, column: str, spec: str) -> None:
    """DataError naming the input unless some document in ``column`` is non-empty (checked in Arrow, no copy)."""
    import pyarrow.compute as pc

    lengths = pc.utf8_length(ds.data.column(column)) if len(ds) and ds.features[column].dtype != "null" else None
    if lengths is None or not (pc.max(lengths).as_py() or 0):
        raise DataError(f"{spec}: no text (every {column!r} field is empty)")


def _encode(task: tuple[int, int, int]) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Worker: documents [start, stop) of input i -> (i, stop - start, ids (n_tokens,) int32, lengths (n_docs,)
    int64) of its non-empty documents, each tokenized alone without special tokens and followed by EOS."""
    i, start, stop = task
    ds, column = _STATE["inputs"][i]
    ids, lengths = data.encode_documents([d for d in ds[start:stop][column] if d], _STATE["tokenizer"])
    return i, stop - start, ids, lengths


def _tasks(inputs: list, workers: int) -> list[tuple[int, int, int]]:
    """Split every input into chunks of documents: about 8 per worker, 16 to 1024 documents each."""
    total = sum(len(ds) for ds, _ in inputs)
    chunk = int(min(1024, max(16, -(-total // (8 * workers)))))
    return [(i, a, min(a + chunk, len(ds))) for i, (ds, _) in enumerate(inputs) for a in range(0, len(ds), chunk)]


@contextlib.contextmanager
def _results(tasks: list, workers: int) -> Iterator[Iterator]:
    """Yield the encoded chunks in task order, from a forked pool of ``workers`` processes (in-process for 1)."""
    if workers == 1:
        yield map(_encode, tasks)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield pool.imap(_encode, tasks)


def _builder_class():
    """megatron-core's IndexedDatasetBuilder (its import pulls in all of megatron.core: seconds, and warnings)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError as e:
        raise DataError(f"launch/preprocess.py writes through megatron-core ({e}); pip install megatron-core") from e
    return IndexedDatasetBuilder


def _write(out: pathlib.Path, dtype: type, workers: int) -> dict:
    """Tokenize _STATE's inputs into out.bin/out.idx through megatron-core's builder: temporary names first, then
    renamed, the .idx last (a crash never leaves a pair that looks complete). Returns counts, time and rate."""
    from tqdm import tqdm

    builder_class = _builder_class()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = (pathlib.Path(f"{out}.{ext}.tmp{os.getpid()}") for ext in ("bin", "idx"))
    n_docs, n_tokens, start = 0, 0, time.perf_counter()
    try:
        builder = builder_class(str(tmp_bin), dtype=dtype)
        total = sum(len(ds) for ds, _ in _STATE["inputs"])
        with (
            _results(_tasks(_STATE["inputs"], workers), workers) as results,
            tqdm(total=total, unit="doc", desc="tokenize", file=sys.stderr, mininterval=0.5) as bar,
        ):
            for _, n_read, ids, lengths in results:
                for piece in np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else ():
                    builder.add_document(piece, [len(piece)])
                n_docs, n_tokens = n_docs + len(lengths), n_tokens + len(ids)
                bar.update(n_read)
                bar.set_postfix(tokens=n_tokens, refresh=False)
        builder.finalize(str(tmp_idx))
        elapsed = time.perf_counter() - start
        for final in (f"{out}.idx", f"{out}.bin"):  # never leave a new .bin beside an old .idx
            with contextlib.suppress(FileNotFoundError):
                os.remove(final)
        os.replace(tmp_bin, f"{out}.bin")
        os.replace(tmp_idx, f"{out}.idx")
    finally:
        for tmp in (tmp_bin, tmp_idx):
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    return {
        "prefix": str(out),
        "documents": n_docs,
        "tokens": n_tokens,
        "dtype": np.dtype(dtype).name,
        "seconds": elapsed,
        "tokens_per_s": n_tokens / max(elapsed, 1e-9),
        "workers": workers,
    }


def preprocess(
    inputs: list[str], output: str, tokenizer: str = "", workers: int = 1, text_key: str = "text", split: str = "train"
) -> dict:
    """Check and open every input, load the tokenizer, then write OUTPUT.bin/OUTPUT.idx (see _write). Bad input
    -> DataError naming it, raised before the tokenizer, megatron-core or the output are touched; an output that
    cannot be written -> DataError naming it."""
    if workers < 1:
        raise DataError(f"--workers {workers}: give at least 1")
    with data.quiet_datasets() as cache_dir:
        try:
            _STATE["inputs"] = [open_input(spec, text_key, split, cache_dir) for spec in inputs]
            for spec, (ds, column) in zip(inputs, _STATE["inputs"]):
                check_has_text(ds, column, spec)
            tok = _STATE["tokenizer"] = data.load_tokenizer(tokenizer)
            data.eos_id(tok)  # a tokenizer without EOS fails here, before any worker starts
            try:
                return _write(pathlib.Path(output).expanduser(), index_dtype(len(tok)), workers)
            except OSError as e:  # a read-only folder, a file where a folder should be, a full disk
                where = f"{e.strerror or e}: {e.filename}" if e.filename else f"{e.strerror or e}"
                if isinstance(e, FileExistsError):  # the output's folder, made with exist_ok, is a file
                    where = f"{e.filename} is a file, not a folder"
                raise DataError(
                    f"--output {output}: cannot write {output}.bin/.idx ({where}); give a prefix in a writable "
                    f"folder (its temporary files are removed)"
                ) from None
        finally:
            _STATE.clear()


def main(argv: list[str]) -> int:
    """Parse the command line, run preprocess, print one summary line; bad input -> status 2, one error line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="local .json/.jsonl/.parquet/.txt files or hub names")
    parser.add_argument("--output", required=True, help="PREFIX: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="", help="a tokenizer folder or hub name; '' = the bundled one")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument("--text-key", default="text", help="the field holding each document's text")
    parser.add_argument("--split", default="train", help="the split of a hub dataset")
    args = parser.parse_args(argv)
    try:
        stats = preprocess(args.input, args.output, args.tokenizer, args.workers, args.text_key, args.split)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
        f"({stats['dtype']}) in {stats['seconds']:.2f} s, {stats['tokens_per_s']:,.0f} tokens/s with "
        f"{stats['workers']} worker(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
