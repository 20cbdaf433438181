"""A resume checked against what was saved (checkpoint.verify, engine/trust/saved.py), through launch/pretrain.py.

One run at dp 2 under fsdp (two forked ranks running the launcher in-process) saves steps 2 and 4. Each case
copies those checkpoints, does one thing a CRC cannot see to step 4 (the index's sizes and CRCs made to match) and
resumes it explicitly on one rank (another layout: the digests are exact at any layout):
- (a) one Adam moment of one tensor replaced by step 2's (a file rewritten with a valid CRC): before, resumed;
- (b) a resharding bug: the real reader (format.Reader) made to read one tensor's two pieces (rank 0's rows,
  rank 1's) in each other's place (patched in this process before the fork); before, resumed;
- (c) the run position edited consistently to step 2's (step, scheduler, Adam's step, samples): before, resumed;
- (d) the optimizer states gone from the index and the shards: before, resumed with a fresh optimizer.
Each is refused with one line naming what differs, exit 2. A clean resume passes on one rank, at fsdp dp 2 (the same
layout, two ranks) and at ddp dp 4 (each rank digesting a quarter of whole tensors), and a checkpoint without
digests (an older engine's) resumes with one notice.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import format as ckpt_format
from engine.checkpoint.format import file_crc32
from engine.metrics.memory import LiveTensorBytes
from engine.trust.saved import FIELD, combine, compare, piece_digest, probe_batch, splitmix64, verdict
from tests.checkpoint.runs import SMALL, edit_index, launched
from tests.cli import one_error_line, run_script
from tests.dist import run_ranks

# fsdp at dp 2: each rank writes a row range of every tensor (a resume there once met a collective on rank 0 only)
RUN = [*SMALL, "--parallel.dp", "2", "--parallel.dp_mode", "fsdp", "--checkpoint.every", "2", "--checkpoint.keep", "0"]
MOMENT = "model.layers.1.mlp.up_proj.weight"


def pretrain_rank(argv: list[str]) -> dict:
    """Rank function: launch/pretrain.py in this rank, on the group run_ranks made (pretrain uses and ends it)."""
    return launched("launch/pretrain.py", argv)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("resumecheck")
    argv = [*RUN, "--train.steps", "4", "--checkpoint.dir", str(tmp / "ckpt"), "--train.out_dir", str(tmp / "out")]
    got = run_ranks(pretrain_rank, 2, argv, timeout_s=300)
    assert [g["code"] for g in got] == [0, 0], got[0]["err"][-3000:]
    return tmp / "ckpt"


def copy(base: Path, tmp: Path) -> Path:
    shutil.copytree(base, tmp / "ckpt")
    return tmp / "ckpt" / "step_000004"


def resume(step: Path, steps: int = 4, *extra: str):
    """Resume ``step`` explicitly on one rank, in a fork, up to ``steps`` (4: check and stop; 5: train one more)."""
    tmp = step.parent.parent  # saves go to a checkpoint.dir of their own (no lineage check sees step 4's folder)
    argv = [*SMALL, "--train.steps", str(steps), "--checkpoint.resume", str(step), "--checkpoint.dir", str(tmp / "new")]
    argv += extra
    return run_script("launch/pretrain.py", *argv, "--train.out_dir", str(tmp / "out"))


def rewrite(step: Path, change) -> None:
    """``change(file, tensors)`` on every shard of ``step``, then its part's size and CRC made to match."""
    for shard in sorted(step.glob("rank_*.safetensors")):
        tensors = load_file(str(shard))
        change(shard.name, tensors)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        part = shard.name.replace("rank_", "part_").replace(".safetensors", ".json")
        edit_index(step, lambda p: p.update(bytes=shard.stat().st_size, crc32=file_crc32(shard)), part)


def test_clean_resumes_pass_at_another_layout_and_at_the_same(base, tmp_path):
    step = copy(base, tmp_path)
    assert json.loads((step / "index.json").read_text())[FIELD]["tensors"][MOMENT].keys() == {
        "param",
        "exp_avg",
        "exp_avg_sq",
    }
    one = resume(step, steps=5)
    assert one.returncode == 0, one.stderr[-3000:]
    assert f"resumed from {step} (step 4" in one.stdout and "notice" not in one.stdout, one.stdout[-2000:]
    argv = [*RUN, "--train.steps", "6", "--checkpoint.resume", str(step), "--checkpoint.dir", str(tmp_path / "new2")]
    same = run_ranks(pretrain_rank, 2, [*argv, "--train.out_dir", str(tmp_path / "out2")], timeout_s=300)
    assert [g["code"] for g in same] == [0, 0], same[0]["err"][-3000:] + same[1]["err"][-3000:]
    assert f"resumed from {step} (step 4" in same[0]["out"], same[0]["out"][-2000:]
    # ddp at dp 4: every rank holds whole tensors and digests, then writes, the quarter that is its own, from an
    # offset inside them (rank 1's [n/4, n/2)); dp 2's halves hide an offset taken with the wrong sign (held[-n/2:]
    # is the second half too). It resumes, trains to step 6 and saves it; one rank resumes that save (issue 45:
    # saved.py's and contents.py's slice with -lo, planted one at a time: this test fails on each)
    argv = [*SMALL, "--parallel.dp", "4", "--train.steps", "6", "--checkpoint.every", "2", "--checkpoint.resume"]
    four = run_ranks(
        pretrain_rank,
        4,
        [*argv, str(step), "--checkpoint.dir", str(tmp_path / "new4"), "--train.out_dir", str(tmp_path / "out4")],
    )
    assert [g["code"] for g in four] == [0] * 4, four[0]["err"][-3000:]
    assert f"resumed from {step} (step 4" in four[0]["out"], four[0]["out"][-2000:]
    again = resume(tmp_path / "new4" / "step_000006", steps=6)
    assert again.returncode == 0 and "resumed from " in again.stdout, again.stdout[-2000:] + again.stderr[-3000:]


def test_an_older_moment_with_a_valid_crc_is_refused(base, tmp_path):
    step = copy(base, tmp_path)
    older = {s.name: load_file(str(s)) for s in (step.parent / "step_000002").glob("rank_*.safetensors")}

    def swap(file: str, tensors: dict) -> None:
        for key in tensors:
            if key.startswith(f"{MOMENT}/exp_avg/"):
                tensors[key] = older[file][key]

    rewrite(step, swap)
    one_error_line(resume(step), f"{MOMENT} exp_avg differs from what was saved", "checkpoint.verify=false")


def test_a_resharding_bug_is_refused(base, tmp_path, monkeypatch):
    step = copy(base, tmp_path)
    flat, n = (
        ckpt_format.Reader._flat,
        math.prod(json.loads((step / "index.json").read_text())["params"][MOMENT]["shape"]),
    )

    def swapped(self, name, state, tp_rank, a, b):  # one tensor's two dp pieces read in each other's place
        if (name, state, a, b) != (MOMENT, "param", 0, n):
            return flat(self, name, state, tp_rank, a, b)
        return torch.cat([flat(self, name, state, tp_rank, n // 2, n), flat(self, name, state, tp_rank, 0, n // 2)])

    monkeypatch.setattr(ckpt_format.Reader, "_flat", swapped)
    one_error_line(resume(step), f"{MOMENT} param differs from what was saved")


def test_a_wrong_schedule_position_is_refused(base, tmp_path):
    step = copy(base, tmp_path)
    older = json.loads((step.parent / "step_000002" / "index.json").read_text())

    def to_step_2(index: dict) -> None:
        for key in ("step", "scheduler", "adam_step", "consumed_samples"):
            index[key] = older[key]

    edit_index(step, to_step_2)
    one_error_line(resume(step), "step 2, saved at 4 (a wrong schedule position)")
    unchecked = resume(step, 4, "--checkpoint.verify", "false")  # the refusal's advice: resume it unchecked
    assert unchecked.returncode == 0 and "resumed from " in unchecked.stdout, unchecked.stderr[-3000:]


def test_a_missing_optimizer_state_is_refused(base, tmp_path):
    step = copy(base, tmp_path)

    def drop_moments(index: dict) -> None:  # the top-level index lists each tensor's states; a part their pieces
        for p in index["params"].values():
            p["states"] = ["param"] if isinstance(p["states"], list) else {"param": p["states"]["param"]}

    for name in ["index.json", *(part.name for part in step.glob("part_*.json"))]:
        edit_index(step, drop_moments, name)
    rewrite(step, lambda file, tensors: [tensors.pop(k) for k in list(tensors) if "/exp_avg" in k])
    one_error_line(resume(step), "exp_avg was saved but not loaded (a missing optimizer state)")


def test_a_checkpoint_without_digests_resumes_with_a_notice(base, tmp_path):
    step = copy(base, tmp_path)
    edit_index(step, lambda index: index.pop(FIELD))
    one = resume(step)
    assert one.returncode == 0, one.stderr[-3000:]
    notices = [line for line in one.stdout.splitlines() if "holds no digests" in line]
    assert notices == [
        f"notice: {step} holds no digests (an older engine's, or checkpoint.verify=false): resumed unchecked"
    ]


def test_the_probe_loss_is_saved_and_a_resume_that_moves_it_is_refused(base, tmp_path):
    """A save records its probe batch's loss (the loss of the weights it wrote) and a resume whose probe loss is off
    by more than fp32's bound (rel 2e-5; bf16's is 4e-3) is refused naming it: the check that catches a model that
    computes otherwise at the new layout though every digest matches. Here the saved loss is moved by rel 1e-3."""
    step = copy(base, tmp_path)
    saved_loss = json.loads((step / "index.json").read_text())[FIELD]["probe_loss"]
    assert isinstance(saved_loss, float) and math.isfinite(saved_loss), saved_loss  # not a save without its probe
    edit_index(step, lambda index: index[FIELD].update(probe_loss=saved_loss * 1.001))
    one_error_line(resume(step), "the probe batch's loss ", f"saved {saved_loss * 1.001:.7g} (beyond rel 2e-05)")


@pytest.mark.parametrize("tp_dim", [0, 1])
def test_the_digest_adds_up_over_any_cut(tp_dim):
    """The digest of a tensor is the sum of its pieces' at any tp cut and flat ranges (what makes it exact at another
    layout), and any two elements swapped change it. The resumes above cut at dp only."""
    t = torch.randn(6, 8)
    whole = piece_digest(t.view(-1), [6, 8], (None, 1, 0), 0)
    total = 0
    for rank, block in enumerate(t.chunk(2, dim=tp_dim)):
        flat = block.reshape(-1)
        for lo, hi in ((0, 5), (5, flat.numel())):  # a ZeRO-like fragment boundary inside the block
            total += piece_digest(flat[lo:hi], [6, 8], (tp_dim, 2, rank), lo)
    assert total % 2**64 == whole
    swapped = t.clone()
    swapped[0, 0], swapped[0, 1] = t[0, 1], t[0, 0]
    assert piece_digest(swapped.view(-1), [6, 8], (None, 1, 0), 0) != whole


def _splitmix64(i: int) -> int:
    """Vigna's splitmix64, the (i + 1)-th output from seed 0, in Python integers (the reference of the digest)."""
    z = (i + 1) * 0x9E3779B97F4A7C15 % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def _reference_digest(t: torch.Tensor) -> int:
    """index.json's KIND written out: sum of fp32 bits (as a signed 32-bit integer) x splitmix64(row) x
    splitmix64(column + 2^40) mod 2^64."""
    bits = t.float().view(torch.int32).tolist()
    return (
        sum(b * _splitmix64(r) * _splitmix64(c + 2**40) for r, row in enumerate(bits) for c, b in enumerate(row))
        % 2**64
    )


def test_the_digest_is_the_documented_sum_and_rank_0_adds_the_ranks_up():
    """The digest index.json records is the formula its KIND names, with splitmix64's published outputs (seed 0:
    e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f), whatever tool recomputes it: the engine's int64 version
    agrees with the reference in Python integers, also past 2^40, and rank 0's record is the ranks' pieces summed."""
    assert [_splitmix64(i) for i in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    at = [0, 1, 2, 7, 2**31 + 5, 2**40, 2**40 + 12345, 2**62 + 1]
    assert [int(v) % 2**64 for v in splitmix64(torch.tensor(at))] == [_splitmix64(i) for i in at]
    t = torch.randn(5, 7)
    whole = piece_digest(t.view(-1), [5, 7], (None, 1, 0), 0)
    assert whole == _reference_digest(t)
    flat = t.view(-1)
    ranks = [{"w": {"param": piece_digest(flat[lo:hi], [5, 7], (None, 1, 0), lo)}} for lo, hi in ((0, 12), (12, 35))]
    assert combine(ranks) == {"w": {"param": f"{whole:016x}"}}


def test_a_row_longer_than_a_digest_chunk_is_digested_whole():
    """A (rows, row length) view whose row holds more elements than a chunk of the digest (2^22) is digested a row
    at a time, not skipped or looped on: the pieces' sum is the whole's, and the last element counts."""
    t = torch.zeros(2, (1 << 22) + 3)
    t[1, -1] = 1.0
    whole = piece_digest(t.view(-1), list(t.shape), (None, 1, 0), 0)
    one = 0x3F800000 * _splitmix64(1) * _splitmix64(t.shape[1] - 1 + 2**40) % 2**64  # 1.0's bits at its place
    assert whole == one


def test_a_digest_holds_temporaries_of_one_chunk_whatever_the_tensor_size():
    """A resume digests every tensor it holds (a 128k x 16k embedding is 2^31 elements): its int64 temporaries are
    bounded by a chunk of the digest (2^22 elements), not by the tensor. Bytes counted at every op (LiveTensorBytes),
    never times: four chunks' worth of rows takes the peak of one (a digest of the whole tensor at once: 4x)."""
    width = 1 << 12
    peaks = []
    for rows in (1 << 10, 1 << 12):  # one chunk, four chunks
        t = torch.ones(rows, width)
        with LiveTensorBytes() as seen:
            piece_digest(t.view(-1), [rows, width], (None, 1, 0), 0)
        peaks.append(seen.peak)
    assert peaks[1] <= 1.25 * peaks[0], peaks


def test_the_probe_batch_is_one_batch_of_token_ids_at_any_dp():
    """The probe batch (seeded) is the same global batch at dp 1 and dp 2 (each rank its rows), holds only token ids
    of the vocabulary (a small one, so every id is drawn), and none is made where the stage takes no batch."""

    class Cfg:
        class train:  # noqa: N801 - the config's section name
            global_batch_size, seq_len = 4, 64

    def at(dp: int, rank: int):
        return type("Ctx", (), {"dp": dp, "dp_rank": rank})

    whole = probe_batch(Cfg, at(1, 0), 8, True)
    assert torch.equal(torch.cat([probe_batch(Cfg, at(2, r), 8, True) for r in (0, 1)]), whole)
    assert whole.shape == (4, 65) and whole.min() >= 0 and whole.max() < 8
    assert probe_batch(Cfg, at(1, 0), 8, False) is None


def test_what_differs_is_listed_and_the_line_names_two():
    """compare() and verdict() (rank 0, after a load) on a saved record and the loaded state, one difference of each
    kind: the line names the first two and counts the rest; a probe loss within the dtype's relative bound passes."""

    class At:
        step, consumed_samples = 4, 96

    saved = {"step": 4, "consumed_samples": 96, "adam_step": 4, "probe_loss": 2.0}
    saved["tensors"] = {"a": {"param": "01", "exp_avg": "02"}, "b": {"param": "03"}}
    same = {"a": {"param": "01", "exp_avg": "02"}, "b": {"param": "03"}}
    assert compare(saved, same, At, 4, (2.0 * (1 + 1.9e-5), torch.float32)) == []
    assert compare(saved, same, At, 4, (2.0 * (1 - 3.9e-3), torch.bfloat16)) == []
    beyond = compare(saved, same, At, 4, (2.0 * (1 - 4.1e-3), torch.bfloat16))  # bf16 weights off by more
    assert beyond == ["the probe batch's loss 1.9918, saved 2 (beyond rel 0.004)"]
    low = saved | {"probe_loss": 0.5}  # a loss under 1 (late in a fine-tuning): the bound stays relative
    assert compare(low, same, At, 4, (0.5 * (1 + 3e-5), torch.float32)) == [
        "the probe batch's loss 0.500015, saved 0.5 (beyond rel 2e-05)"
    ]
    assert compare(saved, same, At, 4, (None, torch.float32)) == [] and verdict("s", []) is None
    wrong = compare(
        saved | {"consumed_samples": 48},
        {"a": {"param": "01", "exp_avg": "0f"}, "b": {"param": "03", "exp_avg": "04"}, "c": {"param": "05"}},
        At,
        3,
        (2.0 * (1 + 2.1e-5), torch.float32),
    )
    assert wrong == [
        "the run position: consumed_samples 96, saved at 48 (a wrong schedule position)",
        "Adam's step count 3, saved at 4 (a wrong schedule position)",
        "a exp_avg differs from what was saved (digest 0f, saved 02)",
        "b exp_avg was loaded but not saved",
        "c param was loaded but not saved",
        "the probe batch's loss 2.000042, saved 2 (beyond rel 2e-05)",
    ]
    assert verdict("ckpt/step_4", wrong[:3]) == (
        "ckpt/step_4 does not resume to the state that was saved: the run position: consumed_samples 96, saved at 48 "
        "(a wrong schedule position); Adam's step count 3, saved at 4 (a wrong schedule position) (and 1 more); a file "
        "rewritten with a valid CRC, a wrong reshard or an edited index: resume an older step (checkpoint.resume "
        "PATH), or set checkpoint.verify=false to resume it unchecked"
    )
    assert "(and" not in verdict("s", wrong[:2])
