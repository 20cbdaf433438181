"""Mutation testing of the fault paths: does the suite notice a small, plausible bug?

    python -m tests.mutation                        # every module of tests/mutation/targets.toml
    python -m tests.mutation engine/json_input.py   # some of them
    python -m tests.mutation --list                 # the map: module -> the tests its mutants run
    python -m tests.mutation --slice 0:100 MODULE   # its first 100 mutants (in the file's order), the rest skipped
    python -m tests.mutation --turn 7 MODULE        # turn 7 of a rotation: TURN_SIZE mutants from 7 x TURN_SIZE on

Each module is mutated one change at a time by cosmic-ray (https://github.com/sixty-north/cosmic-ray): it writes the
mutant to the file on disk, so the tests' forked ranks, launcher subprocesses and torchrun agents all run it (mutmut
3 switches mutants inside the test process and maps tests to functions by tracing it, which misses everything a
test runs in a forked rank or a launched script: most of this project's fault tests). The run happens in a scratch
copy of the checkout (its tracked and untracked files, uncommitted changes included), never in the checkout itself.

Only plausible bugs are planted (``KEEP``): a comparison's boundary or sense flipped, a condition negated, + and -
or * and / swapped, a number off by one, True/False, and/or swapped, a loop that never runs, break/continue swapped,
an except clause that no longer catches. A mutant is killed when its module's tests fail or time out (3x the clean
run). The score per module is killed / (mutants - equivalent ones listed in tests/mutation/equivalent.toml, each
with why - incompetent ones, which cosmic-ray could not run); every survivor is printed with its line and change.
Contributors who touch a module in the map run it for that module before they stop (README, Contributing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; cosmic-ray installs toml, whose loads() reads the same
    import toml as tomllib

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# the operators kept: cosmic-ray's names, matched whole (core/<name>)
KEEP = [
    r"ReplaceComparisonOperator_(Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Eq_NotEq|NotEq_Eq|Is_IsNot|IsNot_Is|In_NotIn|NotIn_In)",
    r"ReplaceBinaryOperator_(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul)",
    r"NumberReplacer",
    r"ReplaceTrueWithFalse",
    r"ReplaceFalseWithTrue",
    r"ReplaceAndWithOr",
    r"ReplaceOrWithAnd",
    r"AddNot",
    r"ZeroIterationForLoop",
    r"ReplaceBreakWithContinue",
    r"ReplaceContinueWithBreak",
    r"ExceptionReplacer",
]


def targets() -> dict[str, list[str]]:
    data = tomllib.loads((HERE / "targets.toml").read_text())
    return {module: entry["tests"] for module, entry in data["modules"].items()}


def equivalents() -> list[dict]:
    return tomllib.loads((HERE / "equivalent.toml").read_text()).get("equivalent", [])


# Without git (a checkout unpacked from an archive): the folders of no checkout's own files, never copied.
NOT_COPIED = {".git", ".venv", "venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}


def listed_files() -> list[str]:
    """The checkout's tracked and untracked (not ignored) files, as git lists them; without git or outside a
    repository, every file under ROOT but in NOT_COPIED folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout.split(b"\0")
        return [os.fsdecode(name) for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        found = (p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file())
        return sorted(str(p) for p in found if not NOT_COPIED & set(p.parts))


def scratch_copy() -> Path:
    """The checkout's files (listed_files), copied to a scratch folder."""
    dest = Path(tempfile.mkdtemp(prefix="mutation-"))
    for name in listed_files():
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def excluded_operators() -> list[str]:
    names = subprocess.run(["cosmic-ray", "operators"], check=True, capture_output=True, text=True).stdout.split()
    keep = re.compile("core/(" + "|".join(KEEP) + ")$")
    return [re.escape(name) + "$" for name in names if not keep.match(name)]


def test_command(tests: list[str]) -> str:
    return " ".join([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests])


def clean_run(work: Path, tests: list[str]) -> float:
    """Seconds the module's tests take unmutated; they must pass, or no mutant's result means anything."""
    start = time.monotonic()
    done = subprocess.run(test_command(tests), shell=True, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the tests {tests} fail without a mutant:\n{done.stdout[-3000:]}")
    return time.monotonic() - start


def write_config(work: Path, module: str, tests: list[str], timeout: float, exclude: list[str]) -> Path:
    config = work / ".mutation" / (module.replace("/", "_") + ".toml")
    config.parent.mkdir(exist_ok=True)
    lines = [
        "[cosmic-ray]",
        f"module-path = {json.dumps(module)}",
        f"timeout = {timeout:.0f}",
        "excluded-modules = []",
        f"test-command = {json.dumps(test_command(tests))}",
        "",
        "[cosmic-ray.distributor]",
        'name = "local"',
        "",
        "[cosmic-ray.filters.operators-filter]",
        f"exclude-operators = {json.dumps(exclude)}",
    ]
    config.write_text("\n".join(lines) + "\n")
    return config


TURN_SIZE = 3  # mutants per turn of ``--turn`` (CI's rotating slice: tests/test_mutation_turn.py)


def turn(items: list, day: int) -> list:
    """Turn ``day`` of a rotation over ``items``: TURN_SIZE of them in a row from day x TURN_SIZE on, wrapping round
    the end, so that successive turns run every item in turn (all of them once every len / TURN_SIZE turns)."""
    start = day * TURN_SIZE % max(len(items), 1)
    return [items[(start + i) % len(items)] for i in range(min(TURN_SIZE, len(items)))]


def keep_slice(session: Path, work: Path, part: slice | int) -> tuple[int, int]:
    """Marks skipped every pending mutant outside ``part`` of the pending ones in the file's order (line, column,
    operator, occurrence: the same order for the same source, whatever order the database keeps), so that a module
    too costly for one sitting runs in parts that add up to the whole; ``part`` an int: that ``turn`` of them.
    Returns (how many it keeps, how many were pending)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    pending = [item for item, result in dump(session, work) if result is None]
    pending.sort(key=lambda i: [(m["start_pos"], m["operator_name"], m["occurrence"]) for m in i["mutations"]])
    kept = chosen(pending, part)
    ids = {item["job_id"] for item in kept}
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in pending:
            if item["job_id"] not in ids:
                db.set_result(item["job_id"], WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return len(kept), len(pending)


def chosen(items: list, part: slice | int) -> list:
    """The items ``part`` keeps: a slice of them (``START:`` keeps all from START: its open end once read as
    ``items[None:]`` skipped every mutant of an open-ended run), or a ``turn``."""
    return turn(items, part) if isinstance(part, int) else items[part]


def mutate(work: Path, module: str, tests: list[str], exclude: list[str], part: slice | int) -> list[tuple[dict, dict]]:
    """Every kept mutant of ``module`` in ``part`` (a slice, or a turn: keep_slice) run against ``tests``:
    [(work item, result)]."""
    seconds = clean_run(work, tests)
    config = write_config(work, module, tests, max(60.0, 3 * seconds), exclude)
    session = config.with_suffix(".sqlite")
    quiet = {"cwd": work, "check": True, "capture_output": True, "text": True}
    subprocess.run(["cosmic-ray", "init", str(config), str(session)], **quiet)
    subprocess.run(["cr-filter-operators", str(session), str(config)], **quiet)
    pending, total = keep_slice(session, work, part)
    print(f"{module}: {pending} of its {total} mutants, {seconds:.0f} s of tests each", flush=True)
    subprocess.run(["cosmic-ray", "exec", str(config), str(session)], **quiet)
    return [line for line in dump(session, work) if line[1] and line[1]["worker_outcome"] != "skipped"]


def dump(session: Path, work: Path) -> list[tuple[dict, dict | None]]:
    out = subprocess.run(["cosmic-ray", "dump", str(session)], cwd=work, check=True, capture_output=True, text=True)
    return [tuple(json.loads(line)) for line in out.stdout.splitlines() if line.strip()]


def mutant_text(result: dict) -> str:
    """The mutated line as the mutant reads (its diff's added line), stripped: how equivalent.toml names a mutant."""
    added = [
        line[1:]
        for line in (result.get("diff") or "").splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    return added[0].strip() if added else ""


def score(module: str, results: list[tuple[dict, dict]]) -> tuple[int, int, list[str], set[str]]:
    """(killed, counted, survivors' lines, equivalent.toml's entries for the module that matched no mutant):
    equivalent mutants are not counted."""
    known = {e["mutant"] for e in equivalents() if e["module"] == module}
    killed, counted, survivors, seen = 0, 0, [], set()
    for item, result in results:
        mutation, text = item["mutations"][0], mutant_text(result)
        if result["test_outcome"] == "incompetent":  # it could not run (the change does not compile or import)
            continue
        if text in known:
            seen.add(text)
            continue
        counted += 1
        if result["test_outcome"] == "killed":
            killed += 1
            continue
        where = f"{module}:{mutation['start_pos'][0]} {mutation['operator_name']}"
        survivors.append(f"  {where}: {text}  [{result['test_outcome'] or result['worker_outcome']}]")
    return killed, counted, survivors, known - seen


def parse_slice(text: str) -> slice | None:
    """``START:END`` (either may be empty) as a slice of non-negative bounds, START < END; None if it is not one."""
    m = re.fullmatch(r"(\d*):(\d*)", text.strip())
    if not m:
        return None
    start, stop = int(m[1] or 0), int(m[2]) if m[2] else None
    return slice(start, stop) if stop is None or start < stop else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help="modules of tests/mutation/targets.toml (default: all)")
    parser.add_argument("--list", action="store_true", help="print the map and stop")
    parser.add_argument("--slice", default=":", help="START:END of each module's mutants in the file's order")
    parser.add_argument("--turn", type=int, help=f"turn N of a rotation: {TURN_SIZE} mutants from N x {TURN_SIZE} on")
    args = parser.parse_args(argv)
    part = parse_slice(args.slice)
    if part is None:
        print(f"error: --slice {args.slice!r} is not START:END with 0 <= START < END (either may be left out)")
        return 2
    if args.turn is not None:
        if args.turn < 0 or args.slice != ":":
            print(f"error: --turn {args.turn} must be a whole number >= 0, and without --slice")
            return 2
        part = args.turn
    table = targets()
    unknown = [m for m in args.modules if m not in table]
    if unknown:
        print(f"error: {', '.join(unknown)} not in tests/mutation/targets.toml; mapped: {', '.join(table)}")
        return 2
    chosen = args.modules or list(table)
    if args.list:
        for module in chosen:
            print(f"{module}: {' '.join(table[module])}")
        return 0
    if shutil.which("cosmic-ray") is None:
        print("error: cosmic-ray is not installed; pip install -c constraints-cpu.txt -e '.[mutation]'")
        return 2
    work, exclude, rows = scratch_copy(), excluded_operators(), []
    try:
        for module in chosen:
            killed, counted, survivors, stale = score(module, mutate(work, module, table[module], exclude, part))
            stale = stale if part == slice(0, None) else set()  # a part runs only some of the listed mutants
            rows.append((module, killed, counted))
            print(f"{module}: {killed} of {counted} killed ({100 * killed / max(counted, 1):.0f} %)")
            print(
                "\n".join(survivors + [f"  stale in equivalent.toml (no such mutant): {t}" for t in stale]), flush=True
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nmodule | killed | mutants | score")
    for module, killed, counted in rows:
        print(f"{module} | {killed} | {counted} | {100 * killed / max(counted, 1):.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
