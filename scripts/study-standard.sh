#!/usr/bin/env bash
# The field's standard stream on SmolLM2-135M (issue 49): `forgetless study standard` at the lowest CPU priority,
# detached (setsid) so that it outlives the shell that starts it, logging to OUT/log.txt; its pid goes to OUT/pid.
# Run it again to resume: every finished arm is reused (continual/plan.py), so a stopped study loses at most the
# arm it was in. Stop it with: kill $(cat OUT/pid)
#   bash scripts/study-standard.sh [OUT]        (default OUT: ~/forgetless-study)
# EXTRA adds flags (e.g. EXTRA="--order1-seeds 3 --force" for more seeds once results.json exists);
# precision fp32 on purpose: an arm records its precision, and auto would be bf16 on one CPU and fp32 on another,
# so arms run on one machine would not be reused on the next.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-$HOME/forgetless-study}")
mkdir -p "$OUT"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" setsid nice -n 19 nohup python -m forgetless study standard \
  --model smollm2-135m --methods 'seq-lora,mtl,seq-lora[mix=0.2],o-lora,moram,osf,lora+ewc,lora+distill' \
  --precision fp32 --seeds 1 --order1-seeds 1 ${EXTRA:-} --out "$OUT/standard" >> "$OUT/log.txt" 2>&1 < /dev/null &
echo $! > "$OUT/pid"
echo "study started (pid $(cat "$OUT/pid")), log: $OUT/log.txt"
