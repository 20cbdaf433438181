"""Tables of parity results: one line per combination (printed), and per family (the "What is proven" table of
docs/proofs.md, which ``--write-readme`` rewrites; the README links to it)."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from dataclasses import asdict
from pathlib import Path

from tests.parity import matrix, runner
from tests.parity.runner import Outcome

BEGIN, END = "<!-- parity-table:begin -->", "<!-- parity-table:end -->"
TABLE_FILE = "docs/proofs.md"  # the file holding the BEGIN ... END block, relative to the repository root
REASONS = {matrix.TIED_ZERO_PP[1]: "a", matrix.ZERO3_PP[1]: "b"}


def append_result(path: Path, c: matrix.Combo, o: Outcome, commit: str) -> None:
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {"combo": asdict(c), "errors": o.errors, "failure": o.failure, "seconds": o.seconds, "commit": commit}
            )
            + "\n"
        )


def read_combo(fields: dict) -> matrix.Combo:
    """A combination from its JSON fields (JSON has no tuples: pp_layers comes back a list, which would leave the
    combination unhashable)."""
    return matrix.Combo(**{**fields, "pp_layers": tuple(fields.get("pp_layers", ()))})


def save_results(path: Path, results: dict) -> None:
    """Rewrite ``path`` with the lines of the combinations in ``results`` (their commits kept)."""
    lines = [
        t
        for t in (path.read_text().splitlines() if path.is_file() else [])
        if read_combo(json.loads(t)["combo"]) in results
    ]
    path.write_text("".join(t + "\n" for t in lines))


def commits(path: Path) -> str:
    """The commits a results file was measured on, in order of first appearance."""
    seen = [json.loads(t)["commit"] for t in path.read_text().splitlines()]
    return " and ".join(dict.fromkeys(seen))


def load_results(path: Path) -> dict:
    """{combo: Outcome} from a results file; the last line of a combination wins."""
    if not path.is_file():
        return {}
    out = {}
    for text in path.read_text().splitlines():
        r = json.loads(text)
        c = read_combo(r["combo"])
        # Judged again against today's bounds (runner.py): a result kept from a run under other bounds shows as
        # what those bounds say now.
        failure = runner.verdict(r["errors"], runner.tolerance(c)) if r["errors"] else r["failure"]
        out[c] = Outcome(r["errors"], failure, r["seconds"])
    return out


def line(c: matrix.Combo, o: Outcome) -> str:
    e = o.errors
    errs = f"{e['loss']:9.2e} {e['grad_norm']:9.2e} {e['params']:9.2e}" if e else " " * 29
    return f"{c.name:<52} {errs} {o.seconds:6.1f}s  {'ok' if o.failure is None else 'FAIL ' + o.failure}"


def print_results(results: dict) -> tuple[int, int]:
    print(f"{'combination':<52} {'loss':>9} {'grad_norm':>9} {'params':>9}  (worst relative errors)")
    for c in sorted(results):
        print(line(c, results[c]))
    failed = sum(o.failure is not None for o in results.values())
    for tol_name in ("FP32", "BF16", "FSDP_BF16_DEEP", "BF16_TIED_DEEP", "BF16_MOE"):
        tol = getattr(runner, tol_name)
        errs = [o.errors for c, o in results.items() if o.errors and runner.tolerance(c) is tol]
        if errs:
            w = {k: max(e[k] for e in errs) for k in ("loss", "grad_norm", "params")}
            print(
                f"worst of {len(errs)} under {tol_name}: loss {w['loss']:.2e} (bound {tol.loss:.0e}), grad_norm "
                f"{w['grad_norm']:.2e} (bound {tol.grad_norm:.0e}), params {w['params']:.2e} (bound {tol.params:.0e})"
            )
    print(f"parity: {len(results) - failed} passed, {failed} failed")
    return len(results) - failed, failed


def _cell(combos: list, results: dict | None) -> str:
    parts = []
    for dtype in ("fp32", "bf16"):
        these = [c for c in combos if c.dtype == dtype]
        refused = {matrix.refusal(c)[1] for c in these if matrix.refusal(c)}
        ran = [c for c in these if not matrix.refusal(c)]
        if refused and not ran:
            parts.append(f"{dtype} refused ({', '.join(sorted(REASONS[r] for r in refused))})")
        elif results is not None:
            ok = sum(1 for c in ran if c in results and results[c].failure is None)
            parts.append(f"{dtype} {'proven' if ok == len(ran) else 'FAILED'} {ok}/{len(ran)}")
    return "; ".join(parts)


def family_table(results: dict | None) -> str:
    """dp mode x (pp = 1 / pp > 1) x (untied / tied): proven k/n per dtype, or refused with the reason."""
    combos = matrix.all_combos(clip=(False,))
    cols = [
        ("pp = 1", lambda c: c.pp == 1 and not c.tied),
        ("pp = 1, tied", lambda c: c.pp == 1 and c.tied),
        ("pp 2-4", lambda c: c.pp > 1 and not c.tied),
        ("pp 2-4, tied", lambda c: c.pp > 1 and c.tied),
    ]
    rows = ["| dp mode | " + " | ".join(name for name, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode in matrix.DP_MODES + matrix.OFFLOAD_MODES:
        cells = [_cell([c for c in combos if c.dp_mode == mode and pick(c)], results) for _, pick in cols]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def current_commit() -> str:
    """The checked-out commit, marked when engine/ has uncommitted changes (taken when a run starts)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "engine"], capture_output=True, text=True).stdout
    return commit + (" (engine/ modified)" if dirty else "")


def readme_section(results: dict, command: str, commit: str) -> str:
    passed = sum(o.failure is None for o in results.values())
    return "\n".join(
        [
            BEGIN,
            f"Measured {datetime.date.today().isoformat()} on commit {commit} "
            f"with `{command}`: {passed} of {len(results)} supported combinations match one process "
            f"(tp, pp, dp in 1, 2, 4 up to 8 ranks; 1f1b and gpipe; activation checkpointing off and on; sequence "
            f"parallelism off and on at tp > 1; clipping off), {len(matrix.refused())} are refused with the error "
            f"below. Each cell counts the combinations of its family (layouts, schedules, activation checkpointing, "
            f"sequence parallelism).",
            "",
            family_table(results),
            "",
            f"(a) {matrix.TIED_ZERO_PP[0]}. (b) {matrix.ZERO3_PP[0]}.",
            END,
        ]
    )


def write_readme(path: Path, section: str) -> None:
    text = path.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block to replace")
    path.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S))
