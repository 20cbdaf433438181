"""launch/preprocess.py: local jsonl/parquet/txt -> Megatron's indexed format, read back by megatron-core's
IndexedDataset and by TrainData; bad input exits 2 with one line naming the file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from engine.data import blend
from engine.data import dataset as data
from tests.cli import ROOT, one_error_line, run_script

SCRIPT = ROOT / "launch" / "preprocess.py"


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer("")


@pytest.fixture(scope="module")
def script():
    """launch/preprocess.py imported as a module (for its in-process main and helpers)."""
    module_spec = importlib.util.spec_from_file_location("preprocess_under_test", SCRIPT)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # worker processes find functions by module name
    module_spec.loader.exec_module(module)
    return module


def make_documents(n: int, seed: int = 0) -> list[str]:
    """n documents of 0..250 words from the bundled corpus, some empty, some with unicode or the EOS text."""
    rng = np.random.default_rng(seed)
    words = data.BUNDLED_CORPUS.read_text(encoding="utf-8").split()
    docs = [" ".join(rng.choice(words, size=int(rng.integers(0, 250)))) for _ in range(n)]
    docs[3], docs[7], docs[11] = "caf\u00e9 \u00fcber \u65e5\u672c \U0001f600\n\n", "", "before <|endoftext|> after"
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A jsonl (300 documents), a parquet (40) and a txt (one document) preprocessed by a --workers 2 run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    jsonl_docs, parquet_docs, txt_doc = make_documents(300), make_documents(40, seed=1), "A whole file.\nTwo lines.\n"
    (folder / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(jsonl_docs)))
    pq.write_table(pa.table({"text": parquet_docs}), folder / "b.parquet")
    (folder / "c.txt").write_text(txt_doc)
    inputs = [str(folder / name) for name in ("a.jsonl", "b.parquet", "c.txt")]
    prefix = folder / "out" / "corpus"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", *inputs, "--output", str(prefix), "--workers", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    docs = [d for d in jsonl_docs + parquet_docs + [txt_doc] if d]
    return {"prefix": str(prefix), "docs": docs, "inputs": inputs, "stdout": out.stdout, "stderr": out.stderr}


def test_megatron_reads_back_the_tokenizer_ids(corpus, tok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(corpus["prefix"])
    docs = corpus["docs"]
    assert len(ds) == len(docs) == 338 and ds.index.dtype == np.uint16
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))  # one sequence per document
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n_tokens = sum(len(ds[i]) for i in range(len(ds)))
    assert f"{len(docs)} documents, {n_tokens} tokens (uint16)" in corpus["stdout"]
    assert "tokenize" in corpus["stderr"]  # the progress bar
    assert sorted(p.name for p in Path(corpus["prefix"]).parent.iterdir()) == ["corpus.bin", "corpus.idx"]


def test_train_data_reads_back_the_same_stream(corpus, tok):
    stream = np.concatenate(
        [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in corpus["docs"]]
    )
    np.testing.assert_array_equal(blend.read_indexed(corpus["prefix"]), stream)
    np.testing.assert_array_equal(data.tokenize_files(corpus["inputs"], tok), stream)  # on the fly: the same ids
    seq_len = 32
    td = blend.TrainData(
        blend.DataSpec([corpus["prefix"]], [], seq_len, seed=0, vocab_size=4096, valid_fraction=0), tok
    )
    assert td.num_train_samples == (len(stream) - 1) // seq_len
    for g in range(td.num_train_samples):
        i = td.locate(g)[1]
        assert td.train_sample(g).tolist() == stream[i * seq_len : i * seq_len + seq_len + 1].tolist()


def test_index_dtype_follows_megatron(script):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType

    for vocab in (4096, 65499, 65500, 151_936):
        assert script.index_dtype(vocab) == DType.optimal_dtype(vocab)


def test_missing_file_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "missing.jsonl"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", str(missing), "--output", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr == f"error: {missing}: no such file\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "empty.jsonl: no text (the file is empty)"),
        ('{"body": "x"}\n', "empty.jsonl: no field 'text'; its fields are ['body']"),
        ('{"text": ""}\n{"text": null}\n', "empty.jsonl: no text (every 'text' field is empty)"),
        ('{"text": 5}\n', "empty.jsonl: field 'text' must hold strings"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_file(script, tmp_path, capsys, content, match):
    (tmp_path / "empty.jsonl").write_text(content)
    assert script.main(["--input", str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "out" / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err
    assert not (tmp_path / "out").exists()


# issue 42: an output folder that cannot be written was an OSError traceback. case -> (output prefix, its reason)
UNWRITABLE = {
    "a file where the folder should be": (lambda tmp: tmp / "file" / "corpus", "file is a file, not a folder)"),
    # EACCES where sysfs is mounted read-write (no new file, even for root), EROFS in a container's read-only /sys
    "sysfs": (lambda tmp: Path("/sys/corpus"), ": /sys/corpus.bin.tmp"),
}


@pytest.mark.parametrize("case", list(UNWRITABLE))
def test_unwritable_output_is_one_line(tmp_path, case):
    prefix, reason = UNWRITABLE[case][0](tmp_path), UNWRITABLE[case][1]
    if prefix.parent == Path("/sys") and not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs at /sys")
    (tmp_path / "docs.jsonl").write_text('{"text": "one document"}\n')
    (tmp_path / "file").write_text("not a folder")
    out = run_script("launch/preprocess.py", "--input", tmp_path / "docs.jsonl", "--output", prefix, timeout=300)
    one_error_line(out, f"--output {prefix}: cannot write {prefix}.bin/.idx", reason)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "file"]  # no temporary file left
