"""Issue 34 part A, "lose nothing": what launch/convert.py --overwrite, a tokenizer folder and a hostfile may do.

- ``convert export/import --overwrite`` replaces only a folder an earlier export or import wrote (its marker,
  engine/checkpoint/folder.py) and holding nothing else. Each refusal below deleted or replaced data before
  (the checkpoint dir, a step dir, the run's out_dir, a parent of the source, ``.``, the HF source, a live run's
  out_dir, an unrelated folder, an earlier export the user added a file to, an import a run saved into) or wrote a
  probe into ``/`` and ended in a traceback; now: one line, exit 2, and every file that was there is still there,
  byte for byte. A symlink target is followed (the link kept), not replaced by a real folder.
  The checks run again right before the old folder is moved aside: a run that took it meanwhile keeps it.
- A tokenizer folder that needs trust_remote_code: one line, exit 2, its Python never run, even if stdin says "y"
  to transformers' prompt (before: the engine left it to the prompt, and "y" ran it).
- A hostfile host beginning with ``-`` (ssh would read it as an option): refused at parse, ssh never started.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from engine.checkpoint.folder import MARKER
from tests.checkpoint.runs import files, train_six_steps
from tests.cli import ROOT, one_error_line, run_script


def launch(script: str, *args, cwd: Path = ROOT, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python launch/SCRIPT args`` from ``cwd``, in a fork of the test process (tests/cli.py)."""
    return run_script(str(ROOT / "launch" / script), *args, cwd=cwd, stdin=stdin, timeout=600)


def tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target, a directory as 'dir'."""
    out: dict[str, bytes | str] = {}
    for top, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = Path(top) / name
            rel = str(path.relative_to(folder))
            out[rel] = (
                f"link {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir() else path.read_bytes()
            )
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A finished run: out/ (metrics.jsonl), ckpt/ (steps 3 and 6, latest), an export of step 3 (hf/) and an
    import of that export (imported/), all written by the command lines a user runs."""
    root = tmp_path_factory.mktemp("pristine")
    train_six_steps(root)
    for argv in (("export", root / "ckpt" / "step_000003", root / "hf"), ("import", root / "hf", root / "imported")):
        out = launch("convert.py", *argv)
        assert out.returncode == 0, out.stderr[-3000:]
    return root


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    """A copy of ``pristine`` to try destroying."""
    shutil.copytree(pristine, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _live_out_dir(run: Path) -> Path:
    """The run's out_dir as a live job holds it: its LOCK names this (running) process."""
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "started": 1.0, "run": "live"}
    (run / "out" / "LOCK").write_text(json.dumps(lock) + "\n")
    return run / "out"


def _hf_with_license(run: Path) -> Path:
    (run / "hf" / "LICENSE").write_text("the model's licence\n")
    (run / "hf" / "NOTICE").write_text("attributions\n")
    (run / "hf" / "README.md").write_text("# the model card\n")
    return run / "hf"


def _docs(run: Path) -> Path:
    (run / "docs").mkdir()
    for name in ("notes.md", "a.md", "b.md", "c.md"):
        (run / "docs" / name).write_text("unrelated\n")
    return run / "docs"


def _trained_into(run: Path) -> Path:
    """An import a later run saved its steps into (checkpoint.dir = the import)."""
    shutil.copytree(run / "ckpt" / "step_000006", run / "imported" / "step_000006")
    return run / "imported"


def _without_latest(run: Path) -> Path:
    """A checkpoint directory without ``latest`` (a copied folder, a crash before the first save's ``latest``),
    holding three steps."""
    (run / "ckpt" / "latest").unlink()
    shutil.copytree(run / "ckpt" / "step_000006", run / "ckpt" / "step_000009")
    return run / "ckpt"


def _link(folder: Path) -> Path:
    link = folder.with_name(f"{folder.name}-link")
    link.symlink_to(folder)
    return link


# (argv after `convert.py` given the run copy, the cwd (None: the checkout), what the line must name)
CASES = {
    "checkpoint-dir-itself": (lambda r: ("export", r / "ckpt", r / "ckpt"), None, ["ckpt", "source"]),
    "step-dir-latest-names": (
        lambda r: ("export", r / "ckpt/step_000003", r / "ckpt/step_000006"),
        None,
        ["step_000006", "lies inside", "checkpoint directory (latest)"],
    ),
    "run-out-dir": (lambda r: ("export", r / "ckpt", r / "out"), None, ["run's out_dir (metrics.jsonl)"]),
    "parent-of-source": (lambda r: ("export", r / "ckpt", r), None, ["holds the source"]),
    "dot-above-source": (lambda r: ("export", "ckpt", "."), "run", ["current directory"]),
    "import-onto-its-source": (lambda r: ("import", _hf_with_license(r), r / "hf"), None, ["source"]),
    "live-run-out-dir": (lambda r: ("export", r / "ckpt", _live_out_dir(r)), None, ["LOCK"]),
    "unrelated-folder": (
        lambda r: ("export", r / "ckpt", _docs(r)),
        None,
        ["holds a.md, b.md, c.md and 1 more, not written by"],
    ),
    "export-with-user-files": (
        lambda r: ("export", r / "ckpt", _hf_with_license(r)),
        None,
        ["holds LICENSE, NOTICE, README.md, which the earlier convert did not write"],
    ),
    "import-a-run-saved-into": (lambda r: ("import", r / "hf", _trained_into(r)), None, ["step_000006"]),
    # known by its step folders alone, all three named (no "...")
    "checkpoint-dir-without-latest": (
        lambda r: ("export", r / "imported", _without_latest(r)),
        None,
        ["is a checkpoint directory (step_000003, step_000006, step_000009);"],
    ),
    # the source named through a link to the target (an earlier export, which --overwrite may replace): the
    # target would replace its own source (issue 45: comparing the link's path, not where it leads, passed)
    "import-through-a-link-to-its-target": (lambda r: ("import", _link(r / "hf"), r / "hf"), None, ["source"]),
}


@pytest.mark.parametrize("case", CASES)
def test_overwrite_refuses_what_it_would_destroy(run, tmp_path, case):
    argv, cwd, needles = CASES[case]
    argv = argv(run)
    before = tree(tmp_path)
    out = launch("convert.py", *argv, "--overwrite", cwd=run if cwd else ROOT)
    one_error_line(out, *needles, "--overwrite replaces only")
    assert tree(tmp_path) == before, "a refused --overwrite changed or lost files"


def test_overwrite_of_the_root_directory_writes_nothing_there(run, tmp_path):
    before, top = tree(tmp_path), sorted(os.listdir("/"))
    one_error_line(launch("convert.py", "export", run / "ckpt", "/", "--overwrite"), "'/'", "root directory")
    assert tree(tmp_path) == before and sorted(os.listdir("/")) == top


def test_overwrite_follows_a_symlink_and_replaces_an_earlier_import(run, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(run / "hf")
    out = launch("convert.py", "export", run / "ckpt", link, "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    assert link.is_symlink() and os.readlink(link) == str(run / "hf"), "the link was replaced"
    # a new target whose parent does not exist yet is made with its parents
    assert launch("convert.py", "export", run / "ckpt", tmp_path / "new" / "fresh").returncode == 0
    assert files(run / "hf") == files(tmp_path / "new" / "fresh"), "the linked folder is not the new export"
    assert MARKER in files(run / "hf")
    # an earlier import, whole, is what import --overwrite replaces
    out = launch("convert.py", "import", run / "hf", run / "imported", "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (run / "imported").iterdir()) == sorted(
        [MARKER, "config.yaml", "hf_files", "latest", "step_000000"]
    )


def test_a_run_that_starts_in_the_folder_during_an_overwrite_keeps_it(run):
    """The checks run again right before the old folder is moved aside (engine/checkpoint/folder.py finish)."""
    from engine.checkpoint import folder
    from engine.checkpoint.format import CheckpointError

    target, before = run / "hf", tree(run / "hf")
    with pytest.raises(CheckpointError, match="LOCK"):
        with folder.written(target, True, "export folder") as tmp:
            (tmp / "config.json").write_text("{}")
            (target / "LOCK").write_text("{}")  # a run takes the folder while the export writes
    assert tree(target) == {**before, "LOCK": b"{}"}
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")], "a temporary folder was left"


def test_tokenizer_that_needs_remote_code_is_refused_even_if_stdin_says_yes(tmp_path):
    evil = tmp_path / "tok"
    shutil.copytree(ROOT / "engine" / "assets" / "tokenizer", evil)
    config = json.loads((evil / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    (evil / "tokenizer_config.json").write_text(json.dumps(config))
    ran = tmp_path / "RAN"
    (evil / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(ran)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    (tmp_path / "doc.txt").write_text("hello world\n")
    out = launch(
        "preprocess.py",
        "--input",
        tmp_path / "doc.txt",
        "--output",
        tmp_path / "data" / "c",
        "--tokenizer",
        evil,
        stdin="y\n",
    )
    one_error_line(out, str(evil), "needs trust_remote_code", "never runs")
    assert not ran.exists(), "the tokenizer folder's Python ran"


def test_preflight_refuses_a_host_ssh_would_read_as_an_option(tmp_path):
    called = tmp_path / "ssh-called"
    fake = tmp_path / "fake_ssh"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {called}\nexit 255\n')
    fake.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\n-Essh-debug.log slots=1\n")
    out = launch("preflight.py", "--hostfile", hostfile, "--ssh", fake, "--skip-links", cwd=tmp_path)
    one_error_line(out, f"{hostfile} line 2", "'-Essh-debug.log'", "option")
    assert not called.exists(), "ssh was started with the hostfile's hosts"


@pytest.mark.parametrize(
    "host, ok",
    [
        ("root@10.0.0.3", True),
        ("[::1]", True),
        ("fe80::1", True),
        ("node-1.cluster", True),
        ("gpu_node1", True),
        ("-oProxyJump", False),
        ("-x@node1", False),
        ("node1..x", False),
        ("node-", False),
        ("@node1", False),
    ],
)
def test_hostfile_host_names(host, ok):
    from engine.cluster.hostfile import HostfileError, parse_hostfile_text

    if ok:
        assert parse_hostfile_text(f"{host} slots=2\n")[0].name == host
    else:
        with pytest.raises(HostfileError, match="is not valid"):
            parse_hostfile_text(f"{host} slots=2\n")


@pytest.mark.parametrize("command,inside", [("export", "step"), ("import", "step"), ("export", "dir-without-latest")])
def test_a_folder_inside_a_checkpoint_step_is_refused_as_a_target(run, tmp_path, command, inside):
    """Issue 42 item 7: ``convert export ck/step_3 ck/step_3/hf`` was accepted, and the next save's pruning
    deleted the export with the step; an import into a step folder the same. Refused, one line, nothing written.
    A checkpoint directory without ``latest`` is known by its committed steps, all three named."""
    source = run / "ckpt" / "step_000003" if command == "export" else run / "hf"
    target = run / "ckpt" / "step_000003" / "hf"
    where = f"lies inside {run / 'ckpt' / 'step_000003'}, a checkpoint step"
    if inside == "dir-without-latest":
        source, target = run / "imported", _without_latest(run) / "exports" / "hf"
        where = f"lies inside {run / 'ckpt'}, a checkpoint directory (step_000003, step_000006, step_000009),"
    before = tree(tmp_path)
    out = launch("convert.py", command, source, target)
    one_error_line(out, str(target), where, "prunes")
    assert tree(tmp_path) == before, "a refused convert changed or lost files"


def test_a_link_out_of_an_imported_folder_is_never_copied(run, tmp_path):
    """Issue 42 item 7: an HF folder whose generation_config.json linked to any file the user can read copied that
    file into the checkpoint (hf_files) and into every export of it. Refused at import and at export, one line,
    the file's content nowhere; a tokenizer that is a link inside the folder is still carried."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"api_key": "not for the checkpoint"}\n')
    src = tmp_path / "src"
    shutil.copytree(run / "hf", src)
    (src / "tokenizer.json").rename(src / "tokenizer.real.json")
    (src / "tokenizer.json").symlink_to("tokenizer.real.json")  # inside the folder: followed
    assert launch("convert.py", "import", src, tmp_path / "imported").returncode == 0
    copied = tmp_path / "imported" / "hf_files" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == (src / "tokenizer.real.json").read_bytes()
    (src / "generation_config.json").symlink_to(secret)
    before = tree(tmp_path)
    one_error_line(launch("convert.py", "import", src, tmp_path / "again"), "generation_config.json", str(secret))
    assert tree(tmp_path) == before, "a refused import wrote or changed files"
    # a checkpoint whose carried files hold such a link (its tokenizer folder): export refuses it too
    (tmp_path / "imported" / "hf_files" / "generation_config.json").symlink_to(secret)
    before = tree(tmp_path)
    one_error_line(launch("convert.py", "export", tmp_path / "imported", tmp_path / "out"), str(secret), "outside")
    assert tree(tmp_path) == before, "a refused export wrote or changed files"


def test_a_hugging_face_cache_snapshot_imports_through_its_links(run, tmp_path):
    """The hub's cache stores every file of snapshots/<rev>/ as a link to ../../blobs/<hash>: links out of the
    folder, into the same repository's blobs, which import follows (the refusal above must not refuse them)."""
    repo = tmp_path / "models--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, path in enumerate(sorted((run / "hf").iterdir())):
        shutil.copyfile(path, blobs / f"blob{i}")
        (snapshot / path.name).symlink_to(Path("../../blobs") / f"blob{i}")
    out = launch("convert.py", "import", snapshot, tmp_path / "imported")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "imported" / "hf_files" / "tokenizer.json").read_bytes() == (
        run / "hf" / "tokenizer.json"
    ).read_bytes()
