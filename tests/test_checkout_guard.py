"""tests/checkout_guard.py, which tests/conftest.py runs around the session: what a test wrote into the checkout."""

import os

from tests.checkout_guard import changes, shallow, snapshot


def test_changes_name_added_rewritten_and_removed_paths_but_not_caches(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text("train: {}\n")
    (tmp_path / "README.md").write_text("x")
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "basetemp").mkdir()
    before = snapshot(tmp_path, skip=(tmp_path / "basetemp",))
    # what the trial's tests left: a stale LOCK in runs/tiny (an ignored folder)
    (tmp_path / "runs" / "tiny").mkdir()
    (tmp_path / "runs" / "tiny" / "LOCK").write_text('{"pid": 1}')
    # a rewrite of the same size: only the modification time tells
    os.utime(tmp_path / "configs" / "tiny.yaml", ns=(1, 1))
    (tmp_path / "README.md").unlink()
    # caches and a pytest --basetemp inside the checkout are not the tests' doing
    (tmp_path / "tests" / "__pycache__").mkdir(parents=True)
    (tmp_path / "tests" / "__pycache__" / "conftest.cpython-311.pyc").write_bytes(b"x")
    (tmp_path / ".pytest_cache").mkdir()
    (tmp_path / "basetemp" / "test_x0").mkdir()
    got = changes(before, snapshot(tmp_path, skip=(tmp_path / "basetemp",)))
    assert got == [
        "removed README.md",
        "modified configs/tiny.yaml",
        "added runs/tiny",
        "added runs/tiny/LOCK",
        "added tests",
    ], got


def test_no_change_is_no_line(tmp_path):
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "metrics.jsonl").write_text("{}\n")
    assert changes(snapshot(tmp_path), snapshot(tmp_path)) == []


def test_shallow_sees_the_top_two_levels_only(tmp_path):
    """What conftest compares after every test to name the first one that wrote into the checkout (CI's report said
    only 'added runs/tiny' after a 35-minute session; preflight's shared-directory check had made it)."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "basetemp").mkdir()
    before = shallow(tmp_path, skip=(tmp_path / "basetemp",))
    (tmp_path / "runs" / "tiny" / "deep").mkdir(parents=True)
    (tmp_path / "basetemp" / "x").mkdir()
    (tmp_path / "__pycache__").mkdir()
    assert shallow(tmp_path, skip=(tmp_path / "basetemp",)) - before == {"runs/tiny"}
    assert before == {"runs"}
