"""The README's Python examples run as written: each block marked ``<!-- runs in
tests/test_readme.py -->`` is executed, in order, in one namespace (a later block may use what an
earlier one made, as a reader going down the page would)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- runs in tests/test_readme.py -->"


def _blocks() -> list[str]:
    text = README.read_text()
    return re.findall(re.escape(MARK) + r"\s*```python\n(.*?)```", text, flags=re.S)


def test_the_marked_blocks_run_as_written() -> None:
    blocks = _blocks()
    assert len(blocks) == 3, "the quickstart, the parallel step and the offload step"
    ns: dict = {"__name__": "readme"}
    for code in blocks:
        exec(compile(code, str(README), "exec"), ns)
    # what they claim: a step was taken, and the parallel run's gathered parameters are whole
    assert ns["state"].step == 1 and torch.isfinite(ns["metrics"]["loss"])
    assert ns["whole"]["embed"]["tokens"].shape == (256, 128)
    assert ns["metrics"]["offload/h2d_bytes"] > 0
