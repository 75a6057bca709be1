#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU, the GPU-marked tests (Triton kernels against
# their references, offload within its budget, the engine's greedy tokens) and the kernel,
# offload and inference benchmarks, within about 8 minutes; every figure as JSON under $OUT.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh
#
# It installs nothing beyond the project itself (pip install -e ".[dev]", skipped where colfunc
# imports already) and keeps going past a failing step: summary.json says what passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if ! python3 -c "import colfunc, pytest" 2>/dev/null; then
    python3 -m pip install -q -e ".[dev]" || echo "pip install failed; trying what is installed"
fi
exec python3 benchmarks/gpu/run.py --out "$OUT"
