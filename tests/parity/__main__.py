"""Run the parity matrix and print the table of results.

    python -m tests.parity --list                   # the combinations, the CI subset and the refusals; runs nothing
    python -m tests.parity                          # the CI covering subset and offload slice (what `pytest` runs)
    python -m tests.parity --full --write-readme    # every supported combination; refreshes docs/proofs.md's table
    python -m tests.parity --full --rerun-failed --write-readme   # only what failed or is missing in the last run
    python -m tests.parity --full --match zero_bubble --match=-sp  # a slice: names containing every --match

Results go to runs/parity/{full,ci}.jsonl as they are known (one JSON line per combination), so a long run can be
looked at while it goes and resumed with --rerun-failed.

Exit status 0 when every combination matches one process, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.parity import matrix, report

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.parity", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="every supported combination, not the CI subset")
    ap.add_argument("--list", action="store_true", help="print the combinations and exit")
    ap.add_argument(
        "--write-readme", action="store_true", help=f"replace the 'What is proven' table of {report.TABLE_FILE}"
    )
    ap.add_argument(
        "--match",
        action="append",
        default=[],
        help="only combinations whose name contains this text (repeatable: every text)",
    )
    ap.add_argument(
        "--rerun-failed",
        action="store_true",
        help="keep the passed results of the last run's file; run the failed and missing ones",
    )
    args = ap.parse_args(argv)
    if args.write_readme and (not args.full or args.match):
        ap.error("--write-readme needs --full without --match: the 'What is proven' table counts every combination")
    combos = matrix.full_matrix() if args.full else matrix.ci_combos()
    combos = [c for c in combos if all(m in c.name for m in args.match)]
    if args.list:
        for c in combos:
            print(c.name)
        print(f"{len(combos)} combinations to run; {len(matrix.refused())} refused, e.g.:")
        for c in matrix.refused()[:: max(1, len(matrix.refused()) // 8)]:
            print(f"  {c.name}: {matrix.refusal(c)[1]}")
        return 0
    from tests.dist import warm_imports
    from tests.parity.runner import run_combos  # imports torch.distributed and the engine

    torch.set_num_threads(1)  # the parent forks the ranks (tests/conftest.py says why)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every rank at one thread, as the suite runs them (conftest.py)
    warm_imports()
    start, commit = time.time(), report.current_commit()
    path = ROOT / "runs" / "parity" / ("full.jsonl" if args.full else "ci.jsonl")
    kept = report.load_results(path) if args.rerun_failed else {}
    wanted = set(combos)
    kept = {c: o for c, o in kept.items() if c in wanted and o.failure is None}
    path.parent.mkdir(parents=True, exist_ok=True)
    report.save_results(path, kept)

    def on_result(c, o):
        print("result:", report.line(c, o), flush=True)
        report.append_result(path, c, o, commit)

    with tempfile.TemporaryDirectory() as root:
        results = {**kept, **run_combos([c for c in combos if c not in kept], root, on_result=on_result)}
    passed, failed = report.print_results(results)
    print(f"{time.time() - start:.0f} s")
    if args.write_readme:
        command = "python -m tests.parity --full" + (" --rerun-failed" if args.rerun_failed else "") + " --write-readme"
        report.write_readme(ROOT / report.TABLE_FILE, report.readme_section(results, command, report.commits(path)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
