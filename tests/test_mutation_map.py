"""The mutation run's map and options (python -m tests.mutation): a module or test file that moved or was renamed
must fail here, not silently make a module's mutants run no test or a survivor look equivalent."""

from __future__ import annotations

from tests.cli import ROOT
from tests.mutation.__main__ import TURN_SIZE, chosen, equivalents, listed_files, main, parse_slice, targets


def test_every_mapped_module_and_test_file_exists():
    table = targets()
    assert table
    missing = [m for m in table if not (ROOT / m).is_file()]
    missing += [t for tests in table.values() for t in tests if not (ROOT / t.split("::")[0]).is_file()]
    assert not missing, missing
    assert all(table.values()), [m for m, tests in table.items() if not tests]


def test_every_equivalent_mutant_names_a_mapped_module_and_says_why():
    table = targets()
    bad = [e for e in equivalents() if e["module"] not in table or not e.get("why") or not e.get("mutant")]
    assert not bad, bad


def test_a_slice_is_start_end_in_order_and_anything_else_is_refused(capsys):
    assert parse_slice(":") == slice(0, None)
    assert parse_slice("10:") == slice(10, None)
    assert parse_slice(":7") == slice(0, 7)
    assert parse_slice("3:4") == slice(3, 4)
    assert [parse_slice(t) for t in ("4:4", "5:2", "x", "1", "-1:3", "1:2:3")] == [None] * 6
    assert main(["--slice", "5:2", "engine/storage.py"]) == 2
    assert "--slice '5:2' is not START:END" in capsys.readouterr().out


def test_the_parts_of_a_slice_add_up_to_the_whole():
    """``--slice 0:N`` and ``--slice N:`` run every mutant once between them; ``N:`` skipped them all when its open
    end was taken as ``items[None:]``."""
    items = list(range(10))
    assert chosen(items, parse_slice("0:4")) + chosen(items, parse_slice("4:")) == items
    assert chosen(items, parse_slice(":")) == items and chosen(items, parse_slice("3:7")) == [3, 4, 5, 6]


def test_successive_turns_run_every_mutant_and_wrap_round_the_end(capsys):
    """CI's rotating slice (``--turn DAY``): TURN_SIZE mutants a day in the file's order, each turn going on where
    the last one stopped (round the end to the first), so that every mutant runs within len / TURN_SIZE days."""
    for n in (1, 2, 10, 12):
        items = list(range(n))
        runs = [chosen(items, day) for day in range(-(-n // TURN_SIZE) + 3)]
        assert all(len(r) == min(TURN_SIZE, n) for r in runs), (n, runs)
        assert set().union(*runs[: -(-n // TURN_SIZE)]) == set(items), (n, runs)
        if n >= TURN_SIZE:  # fewer: every turn runs them all
            assert all(b[0] == (a[-1] + 1) % n for a, b in zip(runs, runs[1:])), (n, runs)
    assert chosen([], 5) == []
    assert main(["--turn", "-1", "engine/storage.py"]) == 2 and main(["--turn", "2", "--slice", "0:3", "x"]) == 2
    assert "--turn -1 must be a whole number >= 0" in capsys.readouterr().out


def test_a_checkout_without_git_is_copied_without_its_virtual_environment_or_caches(monkeypatch, tmp_path):
    """CI or a contributor may run the suite in a checkout unpacked from an archive, or where git is not installed:
    the scratch copy then takes every file but those of NOT_COPIED (.venv inside the checkout, runs/, caches)."""
    with_git = set(listed_files())
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    without = set(listed_files())
    assert "engine/storage.py" in without and "tests/mutation/targets.toml" in without
    assert with_git - without <= {n for n in with_git if not (ROOT / n).is_file()}, sorted(with_git - without)[:5]
    assert not [n for n in without if n.split("/")[0] in (".git", ".venv", "runs") or "__pycache__" in n]
