"""A version-2 checkpoint rewritten as version 1 (the format before issue 43), for the tests that read both
(tests/checkpoint/test_format.py in-process, tests/checkpoint/test_checkpoint_read.py through the launcher)."""

from __future__ import annotations

import json
from pathlib import Path


def as_version_1(step: Path) -> None:
    """Rewrite ``step`` as the format before issue 43 wrote it: one index.json holding every rank's pieces (as
    ``[file, tp rank, start, end]``), shard sizes and CRCs and RNG states; no parts, no locator."""
    index = json.loads((step / "index.json").read_text())
    parts = [json.loads((step / f"part_{i:05d}.json").read_text()) for i in range(index.pop("parts"))]
    index.pop("locator_bytes")
    for name, p in index["params"].items():
        p.pop("where")
        p["states"] = {s: [] for s in p["states"]}
        for part in parts:
            for state, pieces in part["params"].get(name, {}).get("states", {}).items():
                p["states"][state] += [[part["file"], *piece] for piece in pieces]
    index["files"] = {part["file"]: {"bytes": part.pop("bytes"), "crc32": part.pop("crc32")} for part in parts}
    index["ranks"] = [{k: v for k, v in part.items() if k != "params"} for part in parts]
    (step / "index.json").write_text(json.dumps({**index, "version": 1}))
    for extra in [*step.glob("part_*.json"), step / "locator.jsonl"]:
        extra.unlink()
