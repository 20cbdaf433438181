"""What the test session changed in the checkout: tests write only inside their temporary folders.

A test that trained with the default ``train.out_dir`` (``runs/tiny``, relative to the working directory, which is
the checkout) left a stale ``runs/tiny/LOCK`` there, so the user's next quick start took over a lock it never held.
``snapshot`` lists every file and folder under the checkout with its size and modification time (ignored ones such
as ``runs/`` included; git's own folder and the interpreter's caches excluded); ``changes`` names what differs
between two snapshots. tests/conftest.py takes one at the start of the session and fails the session on any
difference (tests/test_checkout_guard.py tests the comparison).
"""

from __future__ import annotations

import os
from pathlib import Path

# Written by Python and pytest themselves, not by a test: byte-code caches and pytest's own cache.
CACHES = {".git", "__pycache__", ".pytest_cache"}
CACHE_SUFFIXES = (".pyc",)


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Relative path -> (size, mtime_ns) of every file, ("dir",) of every folder under ``root``; the folders in
    ``skip`` (e.g. a pytest --basetemp inside the checkout) and CACHES are left out."""
    skipped = {str(p.resolve()) for p in skip}
    out: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in CACHES and os.path.join(folder, d) not in skipped)
        rel = os.path.relpath(folder, root)
        for d in dirs:
            out[os.path.normpath(os.path.join(rel, d))] = ("dir",)
        for name in files:
            if name.endswith(CACHE_SUFFIXES):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # removed while walking
                continue
            out[os.path.normpath(os.path.join(rel, name))] = (st.st_size, st.st_mtime_ns)
    return out


def shallow(root: Path, skip: tuple[Path, ...] = ()) -> frozenset[str]:
    """The names at the checkout's top and one level below (``runs/tiny``, ``configs/x.yaml``): two directory
    listings per test are cheap enough to run after every test, so the session's report can name the first test
    that added or removed one (a whole-tree snapshot per test would cost seconds)."""
    skipped = {p.resolve() for p in skip}
    names = set()
    for top in os.scandir(root):
        if top.name in CACHES or Path(top.path).resolve() in skipped:
            continue
        names.add(top.name)
        if top.is_dir(follow_symlinks=False):
            try:
                names.update(f"{top.name}/{e.name}" for e in os.scandir(top.path) if e.name not in CACHES)
            except OSError:  # unreadable or removed meanwhile
                pass
    return frozenset(names)


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """One line per path that appeared, disappeared or was rewritten, sorted: 'added runs/tiny/LOCK'."""
    lines = [f"added {p}" for p in after.keys() - before.keys()]
    lines += [f"removed {p}" for p in before.keys() - after.keys()]
    lines += [f"modified {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(lines, key=lambda line: line.split(" ", 1)[1])
