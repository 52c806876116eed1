#!/usr/bin/env bash
# The field's standard stream on SmolLM2-135M (issue 49): `forgetless study standard` at the lowest CPU priority,
# detached (setsid) so that it outlives the shell that starts it, logging to OUT/log.txt; its process group's id
# goes to OUT/pid. The study grows method by method (the ceiling and sequential LoRA first, the costliest, osf,
# last): each step reruns the study with one more method, reusing every finished arm (continual/plan.py), so
# OUT/standard/results.md always holds a complete table (grid, three orders) for the methods done so far.
# Run it again to resume: a stopped study loses at most the arm it was in.
#   bash scripts/study-standard.sh [OUT]        (default OUT: ~/forgetless-study)
#   stop:  kill -- -$(cat OUT/pid)
# EXTRA adds flags (e.g. EXTRA="--order1-seeds 3" for more seeds on order 1);
# precision fp32 on purpose: an arm records its precision, and auto would be bf16 on one CPU and fp32 on another,
# so arms run on one machine would not be reused on the next.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-$HOME/forgetless-study}")
METHODS=(mtl seq-lora 'seq-lora[mix=0.2]' o-lora lora+ewc lora+distill moram osf)
mkdir -p "$OUT"
grow() {  # one study per prefix of METHODS; --force: the folder's run.json names the previous, shorter list
  local n list
  for n in $(seq 2 ${#METHODS[@]}); do
    list=$(IFS=,; echo "${METHODS[*]:0:$n}")
    echo "=== $(date -u '+%F %T') study with: $list"
    python -m forgetless study standard --model smollm2-135m --methods "$list" --precision fp32 --seeds 1 \
      --order1-seeds 1 --force ${EXTRA:-} --out "$OUT/standard" || return
  done
  echo "=== $(date -u '+%F %T') study complete"
}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OUT EXTRA="${EXTRA:-}"
setsid nice -n 19 nohup bash -c "$(declare -p METHODS); $(declare -f grow); grow" >> "$OUT/log.txt" 2>&1 < /dev/null &
echo $! > "$OUT/pid"
echo "study started (process group $(cat "$OUT/pid")), log: $OUT/log.txt; stop: kill -- -$(cat "$OUT/pid")"
