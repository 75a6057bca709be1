"""Run the GPU check's steps, each with a deadline, and write what they report as JSON.

``summary.json``: per step its command, exit code, seconds and whether it passed, and the GPU's
name and memory; ``<step>.json``: the step's output lines (the benchmarks' tables) and, for the
tests, each test's outcome. ``benchmarks/gpu/run.sh`` is the entry point.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# (name, command, deadline in seconds): about 8 minutes in all
STEPS = [
    ("tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], 200),
    ("triton_kernels", [sys.executable, "benchmarks/triton_kernels.py"], 90),
    (
        "offload",
        [sys.executable, "benchmarks/offload.py", "--steps", "6", "--budget-mb", "256"],
        90,
    ),
    (
        "inference",
        [sys.executable, "benchmarks/inference.py", "--requests", "32", "--repeats", "2"],
        90,
    ),
]


def _gpu() -> dict[str, object]:
    import torch

    if not torch.cuda.is_available():
        return {"available": False}
    p = torch.cuda.get_device_properties(0)
    return {
        "available": True,
        "name": p.name,
        "memory_bytes": p.total_memory,
        "torch": torch.__version__,
    }


def _tests(junit: Path) -> list[dict[str, object]]:
    if not junit.is_file():
        return []
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or "")[:500]
                break
        else:
            message = ""
        out.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder to write the JSON into")
    parser.add_argument("--only", nargs="*", help="run only these steps")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"gpu": _gpu(), "steps": []}
    for name, command, deadline in STEPS:
        if args.only and name not in args.only:
            continue
        if name == "tests":
            command = [*command, f"--junitxml={out / 'tests.xml'}"]
        start = time.monotonic()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=deadline)
            code, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code = 124
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        seconds = round(time.monotonic() - start, 1)
        record: dict[str, object] = {"command": command, "exit": code, "seconds": seconds}
        report = {**record, "lines": text.splitlines()[-400:]}
        if name == "tests":
            report["tests"] = _tests(out / "tests.xml")
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        summary["steps"].append({"step": name, **record, "passed": code == 0})  # type: ignore[union-attr]
        print(f"{name}: exit {code} in {seconds} s", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(s["passed"] for s in summary["steps"]) else 1  # type: ignore[union-attr]


if __name__ == "__main__":
    raise SystemExit(main())
