"""The README and docs/ as a user meets them: install, quick start and the multi-node commands on the README's first
120 lines, the test command the one CI runs, every relative link and anchor resolving, and the parity writer
(``python -m tests.parity --full --write-readme``) touching only its table in docs/proofs.md. Reads files only."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli import ROOT
from tests.parity import report

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    heads = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_install_quick_start_and_multi_node_commands_on_the_first_screens():
    first = (ROOT / "README.md").read_text().splitlines()[:120]
    for command in (
        "pip install -c constraints-cpu.txt -e .",
        "pip install -c constraints-cpu.txt -e . && python launch/pretrain.py --config configs/tiny.yaml",
        "python launch/preflight.py --hostfile",
        "deepspeed --hostfile",
        "torchrun --nnodes",
        "sbatch examples/slurm.sbatch",
    ):
        assert any(line.startswith(command) for line in first), f"not on the README's first 120 lines: {command}"


def test_the_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text().splitlines(), f"the README lacks .ci/run's command: {ci}"


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc.name}: {target} (no such heading)")
    assert bad == []


def test_the_parity_writer_changes_only_its_table(tmp_path):
    source = ROOT / report.TABLE_FILE
    text = source.read_text()
    copy = tmp_path / "proofs.md"
    copy.write_text(text)
    section = f"{report.BEGIN}\nanother table\n{report.END}"
    report.write_readme(copy, section)
    before, after = text.split(report.BEGIN), copy.read_text().split(report.BEGIN)
    assert len(before) == len(after) == 2 and before[0] == after[0], "text before the table changed"
    assert before[1].split(report.END)[1] == after[1].split(report.END)[1], "text after the table changed"
    assert after[1].split(report.END)[0] == "\nanother table\n"
    report.write_readme(copy, f"{report.BEGIN}{before[1].split(report.END)[0]}{report.END}")
    assert copy.read_text() == text, "writing the old table back did not restore the file"


def test_the_parity_results_file_reads_back_uneven_rows(tmp_path):
    """``--rerun-failed`` and ``--write-readme`` read the results file back: a row with an uneven split (its
    pp_layers a JSON list) must come back as the same, hashable combination."""
    from tests.parity import matrix
    from tests.parity.runner import Outcome

    results, row = tmp_path / "ci.jsonl", matrix.UNEVEN_CI[0]
    report.append_result(results, row, Outcome({}, "planted", 1.0), "abc")
    assert report.load_results(results) == {row: Outcome({}, "planted", 1.0)}
    report.save_results(results, {row: None})
    assert len(results.read_text().splitlines()) == 1
