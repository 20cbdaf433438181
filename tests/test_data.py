"""Data pipeline: bundled tokenizer, file tokenization, packing, the global batch order and its resume, errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import data
from engine.data import DataError, GlobalBatchSampler, PackedDataset

ROUND_TRIP = "First Citizen:\nBefore we proceed,  hear me.\t\n\n caf\u00e9 \u00fcber \u65e5\u672c \U0001F600 <|endoftext|> \r\n  "


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer("")


def expected_ids(tok, docs: list[str]) -> list[int]:
    """The reference: each document tokenized alone without special tokens, followed by EOS."""
    out = []
    for d in docs:
        out += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def test_bundled_tokenizer_loads_offline_and_round_trips(monkeypatch):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any hub request would fail loudly
    tok = AutoTokenizer.from_pretrained(str(data.BUNDLED_TOKENIZER))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 4096 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None
    assert tok.pad_token_id == tok.bos_token_id == tok.eos_token_id
    for text in [ROUND_TRIP, open(data.BUNDLED_CORPUS, encoding="utf-8").read()[:5000], "", " ", "\n"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert (data.BUNDLED_TOKENIZER / "tokenizer.json").stat().st_size < 1_000_000
    assert data.BUNDLED_CORPUS.stat().st_size <= 300_000


def test_load_tokenizer_missing_path_names_it(tmp_path):
    with pytest.raises(DataError, match="no_such_tokenizer"):
        data.load_tokenizer(str(tmp_path / "no_such_tokenizer"))


def test_tokenize_files_txt_and_jsonl(tok, tmp_path):
    txt_docs = ["Speak, speak.\n\nAll:\nResolved.  resolved.\n", "Second file\u2014caf\u00e9\n"]
    json_docs = ["First Citizen:\nBefore we proceed", "  two spaces", "\U0001F600 and more\n"]
    txt_paths = []
    for i, d in enumerate(txt_docs):
        (tmp_path / f"doc{i}.txt").write_text(d, encoding="utf-8")
        txt_paths.append(str(tmp_path / f"doc{i}.txt"))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(json_docs)))
    got = data.tokenize_files(txt_paths + [str(jsonl)], tok)
    assert got.dtype == np.int32 and got.ndim == 1
    assert got.tolist() == expected_ids(tok, txt_docs + json_docs)
    body = tmp_path / "body.jsonl"
    body.write_text(json.dumps({"body": "other key"}) + "\n")
    assert data.tokenize_files([str(body)], tok, text_key="body").tolist() == expected_ids(tok, ["other key"])


def test_tokenize_files_parquet(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["one document", "another one\n"]
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    assert data.tokenize_files([str(tmp_path / "d.parquet")], tok).tolist() == expected_ids(tok, docs)


def test_bundled_tokens_match_tokenize_files_and_are_cached(tok):
    tokens = data.load_train_tokens([], tok)
    assert tokens is data.load_train_tokens([], tok)
    assert tokens.dtype == np.int32 and tokens[-1] == tok.eos_token_id and len(tokens) > 50_000
    np.testing.assert_array_equal(tokens, data.tokenize_files([str(data.BUNDLED_CORPUS)], tok))


def test_packed_dataset_windows():
    tokens = np.arange(23, dtype=np.int32)
    ds = PackedDataset(tokens, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == torch.long and sample.shape == (6,)
        assert sample.tolist() == list(range(5 * i, 5 * i + 6))
        if i + 1 < len(ds):
            assert ds[i + 1][0] == sample[-1]  # sample i+1 starts where sample i's inputs end
    batch = data.collate(ds, [3, 0, 3])
    assert batch.shape == (3, 6) and batch.dtype == torch.long and batch[1].tolist() == list(range(6))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_sampler_dp_slices_union_to_the_global_batch():
    full = GlobalBatchSampler(100, 16, seed=7)
    ranks = [GlobalBatchSampler(100, 16, seed=7, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(15):  # crosses epochs 0 -> 1 -> 2
        expected = full.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert all(len(p) == 4 for p in parts)
        assert sum(parts, []) == expected
    assert all(s.consumed_samples == full.consumed_samples == 15 * 16 for s in ranks)


def test_sampler_order_is_a_permutation_per_epoch():
    s = GlobalBatchSampler(64, 8, seed=3)
    epoch0 = sum((s.next_batch() for _ in range(8)), [])
    epoch1 = sum((s.next_batch() for _ in range(8)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(64))  # no repeats within an epoch
    assert epoch0 == np.random.default_rng(3).permutation(64).tolist()
    assert epoch1 == np.random.default_rng(4).permutation(64).tolist()
    assert GlobalBatchSampler(64, 8, seed=3).next_batch() == epoch0[:8]  # deterministic


def test_sampler_resume_at_another_dp_continues_with_the_next_ids():
    reference = GlobalBatchSampler(50, 12, seed=11)
    stream = [reference.next_batch() for _ in range(10)]
    first = [GlobalBatchSampler(50, 12, seed=11, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        for s in first:
            s.next_batch()
    state = first[0].state_dict()
    assert state == {"consumed_samples": 36}
    resumed = [GlobalBatchSampler(50, 12, seed=11, dp_rank=r, dp_size=3) for r in range(3)]
    for s in resumed:
        s.load_state_dict(state)
    for step in range(3, 10):
        assert sum((s.next_batch() for s in resumed), []) == stream[step]
    again = GlobalBatchSampler(50, 12, seed=11, dp_rank=1, dp_size=4, consumed_samples=36)
    assert again.next_batch() == stream[3][3:6]


@pytest.mark.parametrize("content, name, match", [
    (None, "missing.txt", r"missing\.txt: no such file"),
    ("", "empty.txt", r"empty\.txt: no text"),
    ("", "empty.jsonl", r"empty\.jsonl"),
    ('{"body": "x"}\n', "nokey.jsonl", r"nokey\.jsonl: no field 'text'"),
    ("x", "notes.csv", r"notes\.csv: unsupported file type"),
])
def test_tokenize_files_errors_name_the_file(tok, tmp_path, content, name, match):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match):
        data.tokenize_files([str(tmp_path / name)], tok)


def test_too_short_and_bad_batch_errors():
    with pytest.raises(DataError, match=r"has 5 tokens.*seq_len=8 needs 9"):
        PackedDataset(np.arange(5), seq_len=8)
    with pytest.raises(DataError, match=r"global_batch_size=10 .* dp=4"):
        GlobalBatchSampler(100, 10, seed=0, dp_size=4)
    with pytest.raises(DataError, match="consumed_samples"):
        GlobalBatchSampler(100, 8, seed=0).load_state_dict({"consumed": 3})
