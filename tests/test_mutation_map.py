"""The mutation run's map and options (python -m tests.mutation): a module or test file that moved or was renamed
must fail here, not silently make a module's mutants run no test or a survivor look equivalent."""

from __future__ import annotations

from tests.cli import ROOT
from tests.mutation.__main__ import equivalents, main, outside, parse_slice, targets


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
    for text in ("0:4", "4:", ":", "3:7"):
        part = parse_slice(text)
        kept = [i for i in items if i not in outside(items, part)]
        assert kept == items[part], text
