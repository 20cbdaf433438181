"""Data pipeline: bundled tokenizer, file tokenization, packing, the global batch order and its resume, errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from engine.data import blend
from engine.data import dataset as data
from engine.data.dataset import DataError, GlobalBatchSampler, PackedDataset, check_consumed
from tests.cli import one_error_line, run_script
from tests.shrunk import FIVE_STEPS

ROUND_TRIP = (
    "First Citizen:\nBefore we proceed,  hear me.\t\n\n caf\u00e9 \u00fcber \u65e5\u672c \U0001f600 <|endoftext|> "
    "\r\n  "
)


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
    json_docs = ["First Citizen:\nBefore we proceed", "  two spaces", "\U0001f600 and more\n"]
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
    for step in range(15):  # crosses epochs 0 -> 1 -> 2
        expected = full.batch(16 * step)
        parts = [s.batch(16 * step) for s in ranks]
        assert all(len(p) == 4 for p in parts)
        assert sum(parts, []) == expected


def test_sampler_order_is_a_permutation_per_epoch():
    s = GlobalBatchSampler(64, 8, seed=3)
    epoch0 = sum((s.batch(8 * i) for i in range(8)), [])
    epoch1 = sum((s.batch(8 * i) for i in range(8, 16)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(64))  # no repeats within an epoch
    assert epoch0 == np.random.default_rng(3).permutation(64).tolist()
    assert epoch1 == np.random.default_rng(4).permutation(64).tolist()
    assert GlobalBatchSampler(64, 8, seed=3).batch(0) == epoch0[:8]  # deterministic


def test_sampler_resume_at_another_dp_continues_with_the_next_ids():
    reference = GlobalBatchSampler(50, 12, seed=11)
    stream = [reference.batch(12 * step) for step in range(10)]
    consumed = 3 * 12  # a dp=2 run's position after 3 steps (the feed's count; the sampler holds none)
    resumed = [GlobalBatchSampler(50, 12, seed=11, dp_rank=r, dp_size=3) for r in range(3)]
    for step in range(3, 10):
        assert sum((s.batch(consumed) for s in resumed), []) == stream[step]
        consumed += 12
    again = GlobalBatchSampler(50, 12, seed=11, dp_rank=1, dp_size=4)
    assert again.batch(36) == stream[3][3:6]


@pytest.mark.parametrize(
    "content, name, match",
    [
        (None, "missing.txt", r"missing\.txt: no such file"),
        ("", "empty.txt", r"empty\.txt: no text"),
        ("", "empty.jsonl", r"empty\.jsonl"),
        ('{"body": "x"}\n', "nokey.jsonl", r"nokey\.jsonl: no field 'text'"),
        ("x", "notes.csv", r"notes\.csv: unsupported file type"),
    ],
)
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
    for bad in ({"consumed": 3}, -1, True, 2.5):
        with pytest.raises(DataError, match="consumed_samples"):
            check_consumed(bad)
    with pytest.raises(DataError, match="consumed_samples=-8"):
        GlobalBatchSampler(100, 8, seed=0).batch(-8)


# ---- indexed datasets, TrainData: blending, the validation split, resume ----------------------------------------


@pytest.fixture(scope="module")
def megatron_indexed():
    """megatron-core's indexed_dataset module: the reference writer/reader of the format (slow import, once)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def write_indexed(mi, prefix, docs: list[np.ndarray], dtype=np.uint16) -> str:
    """Write docs (one sequence each) with megatron-core's IndexedDatasetBuilder; returns the prefix."""
    builder = mi.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def spec(paths, weights=(), seq_len=4, seed=0, vocab_size=1 << 20, valid_fraction=0.0) -> blend.DataSpec:
    return blend.DataSpec(list(paths), list(weights), seq_len, seed, vocab_size, valid_fraction)


def stream_dataset(mi, tmp_path, name: str, n_samples: int, seq_len: int = 4, start: int = 0) -> str:
    """An int32 indexed dataset whose tokens are start, start+1, ... (n_samples * seq_len + 1 of them)."""
    tokens = np.arange(start, start + n_samples * seq_len + 1)
    return write_indexed(mi, tmp_path / name, np.array_split(tokens, 7), dtype=np.int32)


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65000), (np.int32, 200_000)])
def test_read_indexed_matches_megatron(megatron_indexed, tmp_path, dtype, high):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, high, size=int(n)) for n in rng.integers(1, 300, size=40)]
    prefix = write_indexed(megatron_indexed, tmp_path / "d", docs, dtype)
    ref = megatron_indexed.IndexedDataset(prefix)
    got = blend.read_indexed(prefix)
    assert got.dtype == dtype and ref.index.dtype == dtype
    np.testing.assert_array_equal(got, np.concatenate([ref[i] for i in range(len(ref))]))
    np.testing.assert_array_equal(got, np.concatenate(docs))


def test_indexed_dataset_errors_name_the_file(megatron_indexed, tmp_path):
    prefix = stream_dataset(megatron_indexed, tmp_path, "d", 10)
    (tmp_path / "d.bin").rename(tmp_path / "keep.bin")
    with pytest.raises(DataError, match=r"d\.bin: no such file \(d\.idx is there\)"):
        blend.TrainData(spec([prefix]), None)
    (tmp_path / "keep.bin").rename(tmp_path / "d.bin")
    (tmp_path / "d.idx").rename(tmp_path / "keep.idx")
    with pytest.raises(DataError, match=r"d\.idx: no such file \(d\.bin is there\)"):
        blend.TrainData(spec([prefix + ".bin"]), None)  # a trailing .bin is accepted as the prefix
    (tmp_path / "keep.idx").rename(tmp_path / "d.idx")
    with open(tmp_path / "d.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(DataError, match=r"d\.bin: 20 bytes, but d\.idx describes 41 tokens of int32"):
        blend.read_indexed(prefix)
    (tmp_path / "bad.idx").write_bytes(b"not an index at all, not at all")
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"bad\.idx: not a Megatron indexed-dataset index"):
        blend.read_indexed(str(tmp_path / "bad"))
    empty = write_indexed(megatron_indexed, tmp_path / "empty", [])
    with pytest.raises(DataError, match=r"empty: no tokens"):
        blend.TrainData(spec([empty]), None)
    with pytest.raises(DataError, match=r"'.*nothing': found neither .*nothing\.bin/\.idx"):
        blend.TrainData(spec([str(tmp_path / "nothing")]), None)


def damaged_tokenizer(tmp_path) -> list[str]:
    """The bundled tokenizer's folder with its tokenizer.json cut short (the tokenizers library raised a bare
    Exception: a traceback)."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(data.BUNDLED_TOKENIZER, folder)
    (folder / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes()[:3000])
    return ["--data.tokenizer", str(folder)]


# issue 42, through launch/pretrain.py: each was a traceback. case -> (make(mi, tmp_path) -> argv, the line's words)
UNREADABLE = {
    ".idx mode 000": (lambda mi, tmp: unreadable(mi, tmp, "idx"), "d.idx: cannot be read (Permission denied)"),
    ".bin mode 000": (lambda mi, tmp: unreadable(mi, tmp, "bin"), "d.bin: cannot be read (Permission denied)"),
    "tokenizer.json cut short": (
        lambda mi, tmp: damaged_tokenizer(tmp),
        "tokenizer/tokenizer.json: EOF while parsing a value at line",
    ),
}


def unreadable(mi, tmp_path, which: str) -> list[str]:
    """An indexed dataset whose .idx or .bin the user cannot read (the fork drops root's override of file modes)."""
    prefix = stream_dataset(mi, tmp_path, "d", 64, seq_len=32)
    (tmp_path / f"d.{which}").chmod(0)
    return ["--data.paths", f"[{prefix}]"]


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_data_is_one_line_at_pretrain(megatron_indexed, tmp_path, case):
    make, words = UNREADABLE[case]
    argv = [*FIVE_STEPS, *make(megatron_indexed, tmp_path), "--train.out_dir", str(tmp_path / "run")]
    one_error_line(run_script("launch/pretrain.py", *argv, as_user=True), words)


def test_token_ids_beyond_the_vocabulary_are_refused(megatron_indexed, tmp_path):
    prefix = write_indexed(megatron_indexed, tmp_path / "big", [np.array([1, 2, 70_000, 3, 4, 5])], np.int32)
    with pytest.raises(DataError, match=rf"dataset {prefix}: .*max id 70000.* vocab_size is 4096"):
        blend.TrainData(spec([prefix], seq_len=2, vocab_size=4096), None)


def test_empty_and_too_short_raw_files(tok, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: no text"):
        blend.TrainData(spec([str(tmp_path / "empty.jsonl")], vocab_size=4096), tok)
    (tmp_path / "short.txt").write_text("one two")
    with pytest.raises(DataError, match=r"dataset .*short\.txt: \d tokens; one sample of seq_len=64 needs 65"):
        blend.TrainData(spec([str(tmp_path / "short.txt")], seq_len=64, vocab_size=4096), tok)


def test_long_documents_continue_in_the_next_samples(tok, tmp_path):
    docs = ["word " * 100, "short one", "another long document " * 30]  # the long ones are many samples long
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stream = expected_ids(tok, docs)
    assert len(tok(docs[0], add_special_tokens=False)["input_ids"]) > 3 * 16
    td = blend.TrainData(spec([str(path)], seq_len=16, vocab_size=4096), tok)
    assert td.num_train_samples == (len(stream) - 1) // 16 and td.num_valid_samples == 0
    by_index = {td.locate(g)[1]: td.train_sample(g) for g in range(td.num_train_samples)}
    assert sorted(by_index) == list(range(td.num_train_samples))  # every packed sample exactly once per epoch
    for i, sample in by_index.items():
        assert sample.tolist() == stream[16 * i : 16 * i + 17]  # sample i+1 continues where sample i stops


def test_blend_weights_are_honoured(megatron_indexed, tmp_path):
    paths = [
        stream_dataset(megatron_indexed, tmp_path, f"d{i}", n, start=i * 100_000)
        for i, n in enumerate([3000, 9000, 500])
    ]
    td = blend.TrainData(spec(paths, weights=[5, 3, 2], seed=3), None)  # normalised to 0.5 / 0.3 / 0.2
    assert td.num_train_samples == 12_500 and td.weights.tolist() == pytest.approx([0.5, 0.3, 0.2])
    sampler = GlobalBatchSampler(td.num_train_samples, 16, seed=3)
    ids = sum((sampler.batch(16 * i) for i in range(625)), [])  # 10k samples in the sampler's shuffled order
    counts = np.bincount([td.locate(g)[0] for g in ids], minlength=3)
    assert np.abs(counts / 10_000 - [0.5, 0.3, 0.2]).max() < 0.01
    # Every prefix of the blend order tracks the weights within ~1 sample, no worse than Megatron's greedy helper.
    from megatron.core.datasets import helpers

    w = np.array([0.5, 0.3, 0.2])
    ref_index, ref_sample = np.zeros(12_500, np.int16), np.zeros(12_500, np.int64)
    helpers.build_blending_indices(ref_index, ref_sample, w, 3, 12_500, False)
    ours = np.array([td.locate(g)[0] for g in range(12_500)])
    steps = np.arange(1, 12_501)[:, None]
    err = np.abs(np.cumsum(ours[:, None] == np.arange(3), 0) - w * steps).max()
    ref_err = np.abs(np.cumsum(ref_index[:, None] == np.arange(3), 0) - w * steps).max()
    assert err <= 1 and err <= ref_err + 0.5  # here 0.5 vs 0.6 samples
    # Dataset 2 (500 samples, 2500 slots) repeats: each of its samples 5 times; dataset 1 gives a 3750-subset.
    per_sample = np.bincount([td.locate(g)[1] for g in range(12_500) if td.locate(g)[0] == 2])
    assert per_sample.tolist() == [5] * 500
    subset = [td.locate(g)[1] for g in range(12_500) if td.locate(g)[0] == 1]
    assert len(subset) == len(set(subset)) == 3750 and max(subset) > 8000  # seeded subset, not the head
    sample = td.train_sample(ids[0])
    d, i = td.locate(ids[0])
    assert sample.tolist() == list(range(d * 100_000 + 4 * i, d * 100_000 + 4 * i + 5))


def test_default_weights_are_proportional_to_size(megatron_indexed, tmp_path):
    paths = [stream_dataset(megatron_indexed, tmp_path, f"d{i}", n) for i, n in enumerate([300, 100])]
    td = blend.TrainData(spec(paths, valid_fraction=0.01), None)
    # 3 + 1 valid samples held out; keeping them token-disjoint from training costs one more sample each.
    assert ([len(t) for t in td.train], td.num_valid_samples) == ([296, 98], 4)
    assert td.weights.tolist() == pytest.approx([296 / 394, 98 / 394])
    located = sorted(td.locate(g) for g in range(td.num_train_samples))
    assert located == [(0, i) for i in range(296)] + [(1, i) for i in range(98)]  # each sample once per epoch
    with pytest.raises(DataError, match="data.weights"):
        blend.TrainData(spec(paths, weights=[1.0]), None)
    with pytest.raises(DataError, match="data.weights"):
        blend.TrainData(spec(paths, weights=[0.0, 0.0]), None)
    with pytest.raises(DataError, match="valid_fraction"):
        blend.TrainData(spec(paths, valid_fraction=1.0), None)


def test_validation_samples_never_train(megatron_indexed, tmp_path):
    paths = [stream_dataset(megatron_indexed, tmp_path, f"d{i}", n, start=10_000 * i) for i, n in enumerate([200, 50])]
    td = blend.TrainData(spec(paths, weights=[0.2, 0.8], valid_fraction=0.05), None)
    assert [len(v) for v in td.valid] == [10, 3] and td.num_valid_samples == 13  # round(2.5) = 3: half up
    train_tokens = {t for g in range(td.num_train_samples) for t in td.train_sample(g).tolist()}
    batches = list(td.valid_batches(5))
    assert [b.shape for b in batches] == [(5, 5)] * 3  # ceil(13 / 5) batches, the last filled up from the start
    valid_tokens = {t for b in batches for t in b.flatten().tolist()}
    assert not train_tokens & valid_tokens  # not even the boundary token is shared
    assert len({tuple(r) for b in batches for r in b.tolist()}) == 13  # every held-out sample is evaluated
    again = list(td.valid_batches(5, max_batches=2))
    assert len(again) == 2 and all(torch.equal(a, b) for a, b in zip(again, batches))
    none = blend.TrainData(spec(paths), None)
    assert none.num_valid_samples == 0 and list(none.valid_batches(4)) == []
    tiny = blend.TrainData(spec([stream_dataset(megatron_indexed, tmp_path, "t", 2)], valid_fraction=0.5), None)
    assert (tiny.num_train_samples, tiny.num_valid_samples) == (2, 0)  # 9 tokens < 2 * seq_len + 2: nothing held out


def test_bundled_default_describes_itself(tok):
    from engine.config import Config

    cfg = Config()
    cfg.train.seq_len, cfg.train.seed, cfg.model.vocab_size = 128, 1234, 4096
    assert blend.spec_from_config(cfg) == blend.DataSpec([], [], seq_len=128, seed=1234, vocab_size=4096)
    td = blend.TrainData(blend.spec_from_config(cfg), tok)
    assert td.num_valid_samples >= 1 and td.num_train_samples > 400
    line = td.describe()
    assert "\n" not in line and "bundled corpus" in line and f"{td.num_train_samples} train" in line
    train = {tuple(td.train_sample(g).tolist()) for g in range(td.num_train_samples)}
    assert not train & {tuple(r) for b in td.valid_batches(8) for r in b.tolist()}
    assert blend.batch_from(td, [3, 0, 3]).shape == (3, 129) and blend.batch_from(td, []).shape == (0, 129)
    with pytest.raises(DataError, match=r"token ids span .* vocab_size is 100"):
        blend.TrainData(blend.DataSpec([], [], seq_len=128, seed=1234, vocab_size=100), tok)


def test_dp_layouts_and_resume_consume_the_same_global_samples(megatron_indexed, tmp_path):
    paths = [stream_dataset(megatron_indexed, tmp_path, f"d{i}", n, start=10_000 * i) for i, n in enumerate([70, 30])]
    td = blend.TrainData(spec(paths, weights=[0.7, 0.3], seed=5), None)
    gbs, steps = 8, 30  # 240 samples: crosses two epochs of 100
    single = GlobalBatchSampler(td.num_train_samples, gbs, seed=5)
    reference = [single.batch(gbs * step) for step in range(steps)]
    ranks = [GlobalBatchSampler(td.num_train_samples, gbs, seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    for step in range(steps):
        parts = [s.batch(gbs * step) for s in ranks]
        assert sum(parts, []) == reference[step]
        assert torch.equal(torch.cat([blend.batch_from(td, p) for p in parts]), blend.batch_from(td, reference[step]))
    seen, consumed = [], 0  # a dp=4 run stopped after 11 steps, resumed at dp=2, then at dp=1
    for dp, steps_run in ((4, 11), (2, 9), (1, 10)):
        ranks = [GlobalBatchSampler(td.num_train_samples, gbs, seed=5, dp_rank=r, dp_size=dp) for r in range(dp)]
        for _ in range(steps_run):
            seen += sum((s.batch(consumed) for s in ranks), [])
            consumed += gbs
    assert seen == sum(reference, [])  # none skipped, none repeated


def _reader(prefix: str, vocab_size: int, start, done) -> None:
    """One data reader of a job (a forked process): opens the dataset as BatchFeed's TrainData does and puts the
    number of bytes of PREFIX.bin it reduced with max() (the token-range scan) on ``done``."""
    scanned = [0]
    real_max = np.memmap.max

    def counting_max(self, *args, **kwargs):  # counts, then runs numpy's own reduction
        if getattr(self, "filename", None) and str(self.filename).endswith(f"{prefix}.bin"):
            scanned[0] += self.nbytes
        return real_max(self, *args, **kwargs)

    np.memmap.max = counting_max
    start.wait()
    try:
        blend.TrainData(spec([prefix], seq_len=4, vocab_size=vocab_size), None)
        done.put((scanned[0], ""))
    except DataError as e:
        done.put((scanned[0], str(e)))


def read_concurrently(prefix: str, readers: int, vocab_size: int = 4096) -> tuple[float, list[str]]:
    """``readers`` processes open the dataset at once -> (full reads of the .bin among them, their errors)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    start, done = ctx.Barrier(readers), ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(prefix, vocab_size, start, done)) for _ in range(readers)]
    for p in procs:
        p.start()
    results = [done.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    size = os.path.getsize(f"{prefix}.bin")
    return sum(n for n, _ in results) / size, [e for _, e in results if e]


def test_a_corpus_is_scanned_once_per_version_not_once_per_reader(megatron_indexed, tmp_path):
    """Every data reader (N/tp of them in a job) used to scan the whole .bin for its token range; now the first
    reader scans and leaves the range in PREFIX.range.json, keyed on the files' sizes and mtimes, and the rest (of
    this job and of later ones) read it. A rewritten .bin is scanned again, and a token >= vocab_size is still
    refused by every reader."""
    docs = [np.arange(i, i + 5000) % 4000 for i in range(40)]
    prefix = write_indexed(megatron_indexed, tmp_path / "corpus", docs, np.int32)
    reads, errors = read_concurrently(prefix, readers=4)
    assert (reads, errors) == (1, [])
    assert read_concurrently(prefix, readers=4) == (0, [])  # a restart: the range is known
    write_indexed(megatron_indexed, tmp_path / "corpus", [*docs[:-1], np.full(5000, 70_000)], np.int32)
    reads, errors = read_concurrently(prefix, readers=3)
    assert reads == 1 and len(errors) == 3
    assert all(f"dataset {prefix}: token ids span [0, 70000]" in e and "vocab_size is 4096" in e for e in errors)


def _job_rank(prefix: str, argv: list[str]) -> int:
    """One rank of a job (tests.dist.run_ranks): builds the Trainer, which opens the data where this rank reads it
    (BatchFeed); returns the bytes of PREFIX.bin this rank reduced with max() (the token-range scan)."""
    from engine.config import load
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    scanned, real_max = [0], np.memmap.max

    def counting_max(self, *args, **kwargs):  # counts, then runs numpy's own reduction
        if str(getattr(self, "filename", "") or "").endswith(f"{prefix}.bin"):
            scanned[0] += self.nbytes
        return real_max(self, *args, **kwargs)

    np.memmap.max = counting_max
    cfg = load(argv)
    Trainer(cfg, ParallelContext.from_config(cfg))
    return scanned[0]


def test_a_job_of_four_readers_scans_its_corpus_once(megatron_indexed, tmp_path):
    """A dp=4 job (4 data readers, through the Trainer) reads the whole .bin once for its token range, not 4 times."""
    from tests.checkpoint.runs import SMALL
    from tests.dist import run_ranks

    prefix = write_indexed(megatron_indexed, tmp_path / "corpus", [np.arange(20_000) % 4000], np.int32)
    argv = [*SMALL, "--data.paths", f"[{prefix}]", "--train.out_dir", str(tmp_path / "out")]
    argv += ["--checkpoint.resume", "none", "--parallel.dp", "4"]
    scanned = run_ranks(_job_rank, 4, prefix, argv)
    assert sum(scanned) / os.path.getsize(f"{prefix}.bin") == 1 and (tmp_path / "corpus.range.json").is_file()
