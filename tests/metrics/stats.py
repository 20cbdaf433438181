"""The run the step-record tests measure (SMALL): tests/shrunk.py's model for 2 steps, with a peak of 0.5 TFLOP/s
so that MFU is a readable fraction."""

from __future__ import annotations

from tests.shrunk import SHRUNK

SMALL = [
    "--config",
    "configs/tiny.yaml",
    *SHRUNK,
    "--train.steps",
    "2",
    "--log.progress",
    "false",
    "--log.peak_tflops",
    "0.5",
]
