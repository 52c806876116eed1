#!/usr/bin/env bash
# The field's standard stream on SmolLM2-135M (issue 49): `forgetless study standard` at the lowest CPU priority,
# detached (setsid) so that it outlives the shell that starts it, logging to OUT/log.txt; its process group's id
# goes to OUT/pid. The study grows method by method (the ceiling and sequential LoRA first, the costliest, osf,
# last): each step reruns the study with one more method, reusing every finished arm (continual/plan.py), so
# OUT/standard/results.md always holds a complete table (grid, three orders) for the methods done so far.
# Run it again to resume: a stopped study loses at most the arm it was in.
#   bash scripts/study-standard.sh [OUT]        (default OUT: ~/forgetless-study)
#   stop:  kill -- -$(cat OUT/pid)
# Across machines: finished arms' records (a few KB of JSON each: R, per-row hits, metrics, the config they ran)
# live in git under docs/results/study-standard/, the study's evidence. `save` copies OUT's into this checkout
# (commit them); a start first restores them into OUT, so a new machine resumes where the last one stopped.
#   bash scripts/study-standard.sh save [OUT]
# EXTRA adds flags (e.g. EXTRA="--order1-seeds 3" for more seeds on order 1).
# Precision bf16, given (not auto): an arm records its precision, and auto would be bf16 on one CPU and fp32 on
# another, so the arms of one folder would mix. bf16 autocast costs about 0.65x of fp32's time on a CPU that runs
# it natively (AVX-512 BF16 / AMX; the arm benchmark), and 20-100x more where it is emulated (AVX2 only): the script
# refuses there. PRECISION=fp32 starts a study that any CPU can continue (its arms are others: the folder's arms
# are per precision).
set -euo pipefail
cd "$(dirname "$0")/.."
SAVE=""
if [ "${1:-}" = save ]; then SAVE=1; shift; fi
OUT=$(realpath -m "${1:-$HOME/forgetless-study}")
SAVED="$PWD/docs/results/study-standard"
records() {  # the arm records and the base's scores under folder $1, as paths relative to it
  (cd "$1" && find . \( -path './*/arms/*/seed*.json' -name 'seed*.json' -o -path './*/before.json' \) -type f)
}
if [ -n "$SAVE" ]; then
  [ -d "$OUT/standard" ] || { echo "study-standard: $OUT/standard does not exist: give the study's folder" >&2; exit 2; }
  mkdir -p "$SAVED"
  n=$(records "$OUT/standard" | wc -l)
  (cd "$OUT/standard" && records . | xargs -r -d '\n' cp --parents -t "$SAVED")
  echo "copied $n records from $OUT/standard to $SAVED; commit them (git add docs/results/study-standard)"
  exit 0
fi
METHODS=(mtl seq-lora 'seq-lora[mix=0.2]' o-lora lora+ewc lora+distill moram osf)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PRECISION=${PRECISION:-bf16}
if [ "$PRECISION" = bf16 ] && ! python -c 'import sys; from forgetless.device import cpu_bf16; sys.exit(not cpu_bf16())' \
    2>/dev/null; then
  echo "study-standard: this CPU has no native bf16 (AVX-512 BF16 or AMX): the folder's bf16 arms would run 20-100x" \
    "slower here; continue on a CPU that has it, or start another folder with PRECISION=fp32" >&2
  exit 2
fi
mkdir -p "$OUT/standard"
if [ -d "$SAVED" ]; then  # the records in git, where OUT lacks them (OUT's own are kept)
  (cd "$SAVED" && records . | xargs -r -d '\n' cp -n --parents -t "$OUT/standard")
  echo "restored from $SAVED where $OUT/standard lacked them: $(records "$SAVED" | wc -l) records in git"
fi
grow() {  # one study per prefix of METHODS; --force: the folder's run.json names the previous, shorter list
  local n list
  for n in $(seq 2 ${#METHODS[@]}); do
    list=$(IFS=,; echo "${METHODS[*]:0:$n}")
    echo "=== $(date -u '+%F %T') study with: $list"
    python -m forgetless study standard --model smollm2-135m --methods "$list" --precision "$PRECISION" --seeds 1 \
      --order1-seeds 1 --force ${EXTRA:-} --out "$OUT/standard" || return
  done
  echo "=== $(date -u '+%F %T') study complete"
}
export OUT PRECISION EXTRA="${EXTRA:-}"
setsid nice -n 19 nohup bash -c "$(declare -p METHODS); $(declare -f grow); grow" >> "$OUT/log.txt" 2>&1 < /dev/null &
echo $! > "$OUT/pid"
echo "study started (process group $(cat "$OUT/pid")), log: $OUT/log.txt; stop: kill -- -$(cat "$OUT/pid")"
