"""Bad input refused with one line (issue 17, cases 2, 5 and 6), in process: config values, files that are
directories or binary, a hand-edited index.json, a missing DeepSpeed, a jsonl without the text field, an
unwritable or locked checkpoint.dir."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest

from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.format import FORMAT, VERSION, CheckpointError, read_index, write_shard
from engine.checkpoint.lock import LOCK
from engine.cluster.hostfile import HostfileError, parse_hostfile
from engine.config import ConfigError, load
from engine.data import blend
from engine.data import dataset as data
from engine.parallel.dp.zero import _import_deepspeed


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--train.lr", "nan"], "train.lr='nan' is not a finite number"),
        (["--train.lr", "inf"], "train.lr='inf' is not a finite number"),
        (["--model.rope_theta", "nan"], "model.rope_theta='nan' is not a finite number"),
        (["--train.grad_clip", "nan"], "train.grad_clip='nan' is not a finite number"),
        (["--train.beta1", "2"], "train.beta1=2.0 must be in [0, 1)"),
        (["--train.beta2", "1"], "train.beta2=1.0 must be in [0, 1)"),
        (["--train.grad_clip", "-1"], "train.grad_clip=-1.0 and train.weight_decay=0.1 must be >= 0"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused(argv, needle):
    with pytest.raises(ConfigError) as e:
        load(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_config_that_is_a_directory_or_binary(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load(["--config", str(tmp_path)])
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"train:\n  steps: \xff\xfe\x00\x81\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load(["--config", str(binary)])


def test_hostfile_that_is_a_directory_or_binary(tmp_path):
    with pytest.raises(HostfileError, match="is a directory"):
        parse_hostfile(tmp_path)
    binary = tmp_path / "hostfile"
    binary.write_bytes(b"node1 slots=2\n\x89PNG\xff\n")
    with pytest.raises(HostfileError, match="is not UTF-8 text"):
        parse_hostfile(binary)


def test_index_with_a_step_that_is_not_a_number(tmp_path):
    index = {
        "format": FORMAT,
        "version": VERSION,
        "step": "abc",
        "params": {},
        "files": {},
        "ranks": [],
        "config": {},
        "layout": {},
    }
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="step is 'abc', not an integer"):
        read_index(tmp_path)


def test_zero_without_deepspeed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ImportError
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[deepspeed\]"'):
        _import_deepspeed()  # what ZeroEngine calls first


def test_missing_text_field_names_a_key_that_exists(tmp_path):
    tok = data.load_tokenizer("")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": f"document number {i} " * 20}) + "\n" for i in range(40)))
    spec = blend.DataSpec([str(path)], [], 16, 1, len(tok))
    with pytest.raises(data.DataError, match="set data.text_key"):
        blend.TrainData(spec, tok)
    cfg = load(["--data.paths", f"[{path}]", "--data.text_key", "body", "--train.seq_len", "16"])
    assert blend.TrainData(blend.spec_from_config(cfg), tok).num_train_samples > 0


def test_malformed_jsonl_names_the_line_in_the_error_alone(tmp_path, capfd):
    """Issue 23 item 6: the row number was in a separate library log line, the error said only 'An error occurred
    while generating the dataset'."""
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(40)]
    lines[24] = lines[24][:-1]  # the closing brace lost
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(data.DataError) as e:
        blend.TrainData(blend.DataSpec([str(path)], [], 16, 1, 4096), data.load_tokenizer(""))
    assert f"{path}: could not read it as json (line 25 is not valid JSON: " in str(e.value)
    assert "Failed to load JSON" not in capfd.readouterr().err


def test_shards_get_the_mode_of_index_json(tmp_path):
    import torch

    write_shard(tmp_path / "rank_00000.safetensors", {"x": torch.zeros(3)})
    (tmp_path / "index.json").write_text("{}")
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["rank_00000.safetensors"] == modes["index.json"], modes


def _checkpointer(directory, out_dir=None, *args: str) -> Checkpointer:
    out_dir = out_dir or tempfile.mkdtemp()  # not the default runs/tiny of the working directory
    cfg = load(["--checkpoint.dir", str(directory), "--train.out_dir", str(out_dir), *args])
    return Checkpointer(cfg, SimpleNamespace(rank=0, world_size=1))


def test_checkpoint_dir_must_be_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        _checkpointer(tmp_path / "file")
    with pytest.raises(CheckpointError, match="cannot be written"):
        _checkpointer(tmp_path / "file" / "ckpt")


def test_second_job_is_refused_and_its_saves_are_safe(tmp_path, live_pid):
    """A live job's lock (here: a sleeping process) refuses a second one, which leaves the first one's
    save in progress alone; a dead process's lock on this host is taken over."""
    holder = {"host": socket.gethostname(), "pid": live_pid, "started": 0, "run": "other"}
    (tmp_path / LOCK).write_text(json.dumps(holder))
    (tmp_path / "step_000005.tmp-other").mkdir()
    with pytest.raises(CheckpointError, match=f"is in use by pid {live_pid} on host"):
        _checkpointer(tmp_path)
    assert (tmp_path / "step_000005.tmp-other").is_dir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid no longer runs
    holder["pid"] = dead.pid
    (tmp_path / LOCK).write_text(json.dumps(holder))
    ckpt = _checkpointer(tmp_path)
    mine = json.loads((tmp_path / LOCK).read_text())
    # the run its staging folders (step_N.tmp-<run>) name, which the next job's refusal quotes
    assert mine["pid"] == os.getpid() and mine["run"] == ckpt.token, (mine, ckpt.token)
    ckpt.finish()
    assert not (tmp_path / LOCK).exists()


def test_out_dir_is_probed_and_locked_like_checkpoint_dir(tmp_path, live_pid):
    """Issue 23 item 4: two runs on one train.out_dir interleaved their metrics.jsonl; now the second is refused,
    naming the holder. checkpoint.dir equal to out_dir or inside it is the same job's, not a rival."""
    out = tmp_path / "out"
    out.mkdir()
    holder = {"host": socket.gethostname(), "pid": live_pid, "started": 1.7e9, "run": "other"}
    (out / LOCK).write_text(json.dumps(holder))
    with pytest.raises(CheckpointError) as e:
        _checkpointer(tmp_path / "ckpt", out)
    assert (
        f"train.out_dir '{out}' is in use by pid {live_pid} on host {socket.gethostname()} (run other, since 20"
        in str(e.value)
    )
    assert not (tmp_path / "ckpt" / LOCK).exists()  # refused before taking checkpoint.dir's lock
    holder["pid"] = os.getppid()  # the process that forked this one (tests/dist.py ranks): the same job
    (out / LOCK).write_text(json.dumps(holder))
    _checkpointer(tmp_path / "ckpt", out).finish()
    assert not (out / LOCK).exists()
    for ckpt_dir in (out, out / "ckpt"):
        ckpt = _checkpointer(ckpt_dir, out)
        assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
        ckpt.finish()
        assert not (out / LOCK).exists() and not (ckpt_dir / LOCK).exists()


def test_out_dir_or_its_tensorboard_that_is_a_file(tmp_path):
    """Issue 23 item 3: FileExistsError tracebacks from mkdir and from SummaryWriter."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=f"train.out_dir '{tmp_path / 'file'}' is not a directory"):
        _checkpointer(tmp_path / "ckpt", tmp_path / "file")
    (tmp_path / "tensorboard").write_text("x")
    with pytest.raises(
        CheckpointError,
        match=r"log.tensorboard's directory '.*tensorboard' is not a directory; "
        r"move it away, or set log.tensorboard=false",
    ):
        _checkpointer(tmp_path / "ckpt", tmp_path, "--log.tensorboard", "true")


def test_garbage_lock_is_called_unreadable(tmp_path, capsys):
    """Issue 23 item 6: a LOCK holding garbage was described as 'pid -1 ... since 1970'."""
    (tmp_path / LOCK).write_bytes(b"\x00\x17garbage")
    _checkpointer(tmp_path).finish()
    said = capsys.readouterr().out
    assert "taking over an unreadable lock file" in said and "pid -1" not in said and "1970" not in said


def test_metrics_rewind_keeps_a_line_that_is_not_utf8(tmp_path, capsys):
    """Issue 23 item 3: a non-UTF-8 byte in metrics.jsonl made the rewind on resume raise UnicodeDecodeError.
    Such a line, like one cut short by a crash, moves to metrics.rolled_back.jsonl byte for byte."""
    from engine.metrics.logger import MetricsLogger

    good, bad, later, cut = b'{"step": 1}\n', b'{"step": 2, "note": "\xff"}\n', b'{"step": 4}\n', b'{"ste'
    (tmp_path / "metrics.jsonl").write_bytes(good + bad + later + cut)
    MetricsLogger(str(tmp_path), enabled=True, progress=False, total_steps=9).rewind(3)
    assert (tmp_path / "metrics.jsonl").read_bytes() == good
    assert (tmp_path / "metrics.rolled_back.jsonl").read_bytes() == bad + later + cut + b"\n"
    assert "1 records past step 3 and 2 unreadable lines moved" in capsys.readouterr().out


def _claim_rank(cases: list[tuple[list[str], list[str] | None]]) -> list[tuple[str | None, str]]:
    """Rank function: the start-up claim of a world of 2 for each case (argv, rank 1's argv or None: the same);
    this rank's (error or None, what it printed), per case. Rank 1 with an argv of its own stands for a second
    host (h2, the name the shared check reads) with a disk of its own: the directories rank 0 writes are not the
    ones it sees."""
    from unittest import mock

    import torch.distributed as dist

    from engine.cluster import shared

    shared.SETTLE_S = 0.5  # a missing token is waited for: briefly here
    errors = []
    for argv, own in cases:
        elsewhere = own is not None and dist.get_rank() == 1
        said = io.StringIO()
        try:
            with mock.patch("socket.gethostname", return_value="h2") if elsewhere else contextlib.nullcontext():
                cfg = load(own if elsewhere else argv)
                with contextlib.redirect_stdout(said):
                    Checkpointer(cfg, SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size())).finish()
        except CheckpointError as e:
            errors.append((str(e), said.getvalue()))
        else:
            errors.append((None, said.getvalue()))
    return errors


def test_every_rank_refuses_a_bad_out_dir_and_a_checkpoint_dir_not_shared(tmp_path):
    """rank 0 checks train.out_dir; the other ranks must raise its error too, not go on into the first collective
    and hang there until parallel.timeout_s (with checkpoint.dir empty there was no group to tell them). A
    checkpoint.dir that a second host does not share (a disk of its own there) is refused on every rank at start-up,
    before any save lacks that host's shards (engine/cluster/shared.py)."""
    from tests.dist import run_ranks

    (tmp_path / "file").write_text("x")
    out = ["--train.out_dir", str(tmp_path / "out")]
    shared_ckpt = [*out, "--checkpoint.dir", str(tmp_path / "ckpt")]
    cases = [
        (["--train.out_dir", str(tmp_path / "file")], None),
        (shared_ckpt, [*out, "--checkpoint.dir", str(tmp_path / "h2" / "ckpt")]),
    ]
    got = run_ranks(_claim_rank, 2, cases, timeout_s=120)
    errors = [[error for error, _ in rank] for rank in got]
    assert errors[0] == errors[1], errors
    bad_out, not_shared = errors[0]
    assert got[0][1][1] == f"hosts: {socket.gethostname()} ranks 0, h2 ranks 1\n", got[0][1]  # rank 0 names them
    assert "train.out_dir" in bad_out and "is not a directory" in bad_out
    assert not_shared == (
        f"checkpoint.dir '{tmp_path / 'ckpt'}' is not shared by host(s) h2: rank 0 (on {socket.gethostname()}) and "
        "their ranks do not see each other's files there, so a checkpoint would lack their shards; give a directory "
        "on a file system every host mounts"
    ), not_shared


ZERO_PP = [
    "--config",
    "configs/tiny.yaml",
    "--parallel.pp",
    "2",
    "--parallel.dp",
    "2",
    "--parallel.dp_mode",
    "zero",
    "--train.micro_batch_size",
    "1",
    "--train.global_batch_size",
    "8",
]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--parallel.schedule", "zero_bubble", "--parallel.zero_stage", "2"],
            "DeepSpeedZeroOptimizer.reduce_ready_partitions_and_remove_grads",
        ),
        (
            ["--parallel.schedule", "zero_bubble", "--parallel.zero_stage", "1", "--train.dtype", "bf16"],
            "DeepSpeedZeroOptimizer._fill_param_grad_accum_attribute",
        ),
        (
            [
                "--parallel.schedule",
                "interleaved",
                "--parallel.virtual_stages",
                "2",
                "--parallel.zero_stage",
                "2",
                "--parallel.offload",
                "optimizer",
            ],
            "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu",
        ),
    ],
)
def test_zero_under_split_schedules_names_deepspeeds_limit(argv, needle):
    """Issue 27: the ZeRO x schedule combinations DeepSpeed cannot run are refused in one line that names the
    DeepSpeed function whose assumption breaks and what to use instead (checked before any process group)."""
    from engine.parallel.layout.checks import resolve_layout

    with pytest.raises(ConfigError) as e:
        resolve_layout(load([*ZERO_PP, *argv]), 4)
    assert needle in str(e.value) and "\n" not in str(e.value) and "; use " in str(e.value)


def test_zero2_under_interleaved_with_the_optimizer_offloaded_by_the_ds_config_is_refused(tmp_path):
    """As parallel.offload=optimizer above, an offload_optimizer the ds_config file asks for (check_zero_schedule reads
    the file)."""
    from engine.parallel.layout.checks import resolve_layout

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    argv = ["--parallel.schedule", "interleaved", "--parallel.virtual_stages", "2", "--parallel.zero_stage", "2"]
    with pytest.raises(ConfigError, match="async_accumulate_grad_in_cpu_via_gpu"):
        resolve_layout(load([*ZERO_PP, *argv, "--parallel.ds_config", str(ds)]), 4)
