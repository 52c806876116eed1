#!/usr/bin/env bash
# The GPU check (issue 39) in one call, on a machine with one CUDA GPU and no network:
#   bash scripts/gpu-wheels.sh            # here, once: the packages that machine lacks, as wheels in .whl/
#   bash scripts/gpu-check.sh             # there, in the repo root with .whl/ beside it: about 5 minutes
#   bash scripts/gpu-check.sh --dry-run   # on any CPU: a tiny version of every step, to check them
# The steps, their time limits and the report ($OUT or runs/gpu-check/): scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
