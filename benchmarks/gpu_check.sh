#!/usr/bin/env bash
# fnzero on CUDA in one command, from any directory: benchmarks/gpu_check.py with this checkout's
# fnzero first on the path. Arguments are passed on (--device cpu: a dry run on the CPU).
# One line per check (PASS/FAIL/SKIP + figures); exit 0 unless a check FAILs, also without CUDA.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$here/gpu_check.py" "$@"
