#!/usr/bin/env bash
# Regenerate what the results (docs/RESULTS.md and its pages, docs/results/) show, one section at a time, from
# the current code:
#   bash scripts/reproduce.sh SECTION [SECTION ...]     (bash scripts/reproduce.sh list: the sections)
# Each section runs its commands (runs/ keeps every output; finished arms are reused on a re-run), then
# copies its results.md and figures to docs/figures/SECTION/, the files the results' pages show and quote.
# Times are for 2 CPU cores; the real-* sections need `bash scripts/setup.sh real`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs

SECTIONS=(frontier-two-domain frontier-sequence frontier-two-domain-mix frontier-two-domain-capacity frontier-two-domain-ewc frontier-two-domain-goal frontier-two-domain-goal-mix30 frontier-two-domain-goal-confirm frontier-two-domain-goal-more frontier-two-domain-goal-confirm-ewc frontier-two-domain-stdlib frontier-sequence-replay two-domain-quick tiny-renamed apn-ablation two-domain-neutral sequence-quick sequence-ablation
          two-domain-cms sequence-cms optimizers-quick real-standard real-standard-seeds real-standard-replay real-standard-retrofits real-standard-neutral real-trace real-two-domain real-two-domain-folio real-neutral-pace study-standard study-trace
          online-quick hope-two-domain hope-lm hope-needle hope-speed serve first-run benchmarks aunn)

publish() {  # publish RUN_DIR SECTION: its table and the figures the results' pages or README.md show, in docs/figures
    mkdir -p "docs/figures/$2"
    cp "$1"/results.md "docs/figures/$2/"
    for f in $(grep -rho --include='*.md' "figures/$2/[A-Za-z0-9_.-]*\.png" docs/RESULTS.md docs/results README.md | sort -u); do
        cp "$1/${f##*/}" "docs/figures/$2/"; done
    echo "published $1 -> docs/figures/$2 (all its figures stay in $1)"
}

# Neutral Residues read the raw FFN input, and on a pretrained model (--model) trained at lr 1e-3, in every section
# measured before 2026-11-26: `forgetless bench` here pins both so those sections reproduce; real-neutral-pace runs
# today's defaults (unit-RMS input; lr 3e-4 on pretrained models). first-run calls the program itself: unpinned.
forgetless() {
    if [[ $1 == bench && ${PIN_NEUTRAL:-1} == 1 ]]; then
        local pins=(--set neutral.normalize_input=false)
        [[ " $* " == *" --model "* ]] && pins+=(--set neutral.lr=1e-3)
        command forgetless "$@" "${pins[@]}"
    else
        command forgetless "$@"
    fi
}

bench() {  # bench SECTION ARGS...: one forgetless bench into runs/SECTION, then publish it
    local section=$1; shift
    forgetless bench "$@" --out "runs/$section"
    publish "runs/$section" "$section"
}

on_frontier() {  # on_frontier SECTION 'FILES' BENCH_ARGS...: more arms beside the frontier's (runs/frontier-two-domain,
    local section=$1 files=$2; shift 2                             # finished arms reused), then copy FILES to docs/figures/SECTION
    OMP_NUM_THREADS=1 forgetless bench --preset quick --seeds 3 --base-seeds 3 "$@" --out runs/frontier-two-domain
    mkdir -p "docs/figures/$section"
    for f in $files; do cp "runs/frontier-two-domain/$f" "docs/figures/$section/"; done
}

run_section() {
    case "$1" in
    frontier-two-domain) OMP_NUM_THREADS=1 bench frontier-two-domain --preset quick --seeds 3 --base-seeds 3 \
                            --methods full,lora,adapter,neutral,ewc,apn-retrofit --sweep full.lr=1e-4,1e-3 \
                            --sweep ewc.lr=1e-4,1e-3 --sweep lora.lr=3e-4,3e-3 --sweep adapter.lr=3e-4,3e-3 \
                            --sweep neutral.lr=3e-4,3e-3 --sweep apn-retrofit.lr=3e-4,3e-3 ;;                   # ~1.5 h
    frontier-sequence)  OMP_NUM_THREADS=1 bench frontier-sequence --preset quick --protocol sequence --seeds 3 --base-seeds 3 \
                            --workers 2 --methods 'full,seq-lora,moram,ewc,full[mix=0.1;lr=1e-4],full[mix=0.1],full[mix=0.1;lr=1e-3]' \
                            --sweep full.lr=1e-4,1e-3 --sweep ewc.lr=1e-4,1e-3 --sweep seq-lora.lr=3e-5,1e-4,3e-4,3e-3 \
                            --sweep moram.lr=1.5e-4,1.5e-3,5e-3 --data-mix-from shakespeare-modern ;;                                               # ~1.5 h
    frontier-two-domain-mix) OMP_NUM_THREADS=1 bench frontier-two-domain-mix --preset quick --seeds 3 --base-seeds 3 \
                            --mix 0.1 --methods full,ewc,lora --sweep full.lr=1e-4,1e-3 --sweep ewc.lr=1e-4,1e-3 \
                            --sweep lora.lr=3e-4,3e-3 ;;                                                          # ~30 min
    frontier-two-domain-capacity) on_frontier frontier-two-domain-capacity 'results.md frontier.png routing_overlap.png' \
                            --methods 'full,lora,adapter,neutral,ewc,apn-retrofit,adapter[bottleneck=4287],adapter[bottleneck=4287;lr=3e-4],adapter[bottleneck=4287;lr=1e-4],adapter[bottleneck=4287;lr=3e-5]' \
                            --sweep full.lr=1e-4,1e-3 --sweep ewc.lr=1e-4,1e-3 --sweep lora.lr=3e-4,3e-3 \
                            --sweep adapter.lr=3e-4,3e-3 --sweep neutral.lr=3e-4,3e-3 --sweep apn-retrofit.lr=3e-4,3e-3 ;;  # ~1 h more
    frontier-two-domain-ewc) on_frontier frontier-two-domain-ewc 'results.md frontier.png' \
                            --methods 'full,lora,adapter,neutral,ewc,apn-retrofit,ewc[lr=3e-3],ewc[lam=1e3;lr=1e-4],ewc[lam=1e3],ewc[lam=1e3;lr=1e-3],ewc[lam=1e5;lr=3e-4],ewc[lam=1e5;lr=1e-3],ewc[lam=1e5;lr=3e-3]' \
                            --sweep full.lr=1e-4,1e-3 --sweep ewc.lr=1e-4,1e-3 --sweep lora.lr=3e-4,3e-3 \
                            --sweep adapter.lr=3e-4,3e-3 --sweep neutral.lr=3e-4,3e-3 --sweep apn-retrofit.lr=3e-4,3e-3 ;;  # ~20 min more
    frontier-two-domain-goal) on_frontier frontier-two-domain-goal 'results.md frontier.png' \
                            --methods 'full,neutral,ewc,apn-retrofit,ewc[lam=1e3;lr=1e-4],ewc[lam=1e3],ewc[lam=1e3;lr=1e-3],distill,distill[beta=10],distill[beta=10;lr=1e-3],wise-ft,wise-ft[mix=0.1;lr=1e-3],wise-ft[mix=0.1;lr=3e-3],ewc[lam=1e3;mix=0.1;lr=1e-3],neutral[alpha=0.1;lr=3e-3],distill[lr=3e-3],distill[beta=0.3],distill[beta=0.3;lr=1e-3],distill[beta=0.3;lr=3e-3],distill[beta=0.1;lr=1e-3],distill[beta=0.1;lr=3e-3],distill[beta=0.5],distill[beta=0.5;lr=1e-3],distill[beta=0.3;lr=1e-4],full[mix=0.1;lr=1e-4],full[mix=0.1],full[mix=0.1;lr=1e-3],full[mix=0.3;lr=1e-4],full[mix=0.3],full[mix=0.3;lr=1e-3],full[mix=0.5;lr=1e-4],full[mix=0.5],full[mix=0.5;lr=1e-3]' \
                            --sweep full.lr=1e-4,1e-3 --sweep ewc.lr=1e-4,1e-3 --sweep neutral.lr=3e-4,3e-3 \
                            --sweep apn-retrofit.lr=3e-4,3e-3 --sweep distill.lr=1e-4,1e-3 --sweep wise-ft.lr=1e-3,3e-3 ;;  # ~1 h more
    frontier-two-domain-goal-mix30) OMP_NUM_THREADS=1 forgetless bench --preset quick --seeds 3 --base-seeds 3 --workers 2 \
                            --methods 'full,distill[beta=0.5],distill[beta=0.5;mix=0.3],distill[beta=0.5;mix=0.3;lr=1e-3],distill[beta=0.3;mix=0.3],distill[beta=0.3;mix=0.3;lr=1e-3]' \
                            --out runs/frontier-two-domain-goal-mix30                                     # ~25 min
                        mkdir -p docs/figures/frontier-two-domain-goal-mix30
                        cp runs/frontier-two-domain-goal-mix30/{results.md,frontier.png} docs/figures/frontier-two-domain-goal-mix30/ ;;
    frontier-two-domain-goal-confirm) OMP_NUM_THREADS=1 forgetless bench --preset quick --seeds 3 --seed-start 3 --base-seeds 6 \
                            --workers 2 --methods 'full,distill[beta=0.5;mix=0.3;lr=1e-3]' --out runs/goal-confirm   # ~15 min
                        mkdir -p docs/figures/frontier-two-domain-goal-confirm
                        cp runs/goal-confirm/results.md docs/figures/frontier-two-domain-goal-confirm/ ;;
    frontier-two-domain-goal-more) OMP_NUM_THREADS=1 bench frontier-two-domain-goal-more --preset quick --seeds 3 \
                            --base-seeds 3 --workers 2 --methods 'full,full[mix=0.3;lr=1e-4],full[mix=0.3],full[mix=0.3;lr=1e-3],distill[beta=0.5;mix=0.3],distill[beta=0.5;mix=0.3;lr=1e-3],ewc-distill[beta=0.5;mix=0.3],ewc-distill[beta=0.5;mix=0.3;lr=1e-3],ewc-distill[beta=0.5;mix=0.3;lr=2e-3],ewc-distill[beta=0.5;mix=0.3;lr=3e-3],ewc-distill[beta=0.5;mix=0.3;lam=100;lr=1e-3],ewc-distill[beta=0.5;mix=0.3;lam=300;lr=1e-3],apn-local,apn-local[lr=1e-3],apn-local[mix=0.1],apn-local[mix=0.3],apn-local[mix=0.3;lr=1e-3]' ;;  # ~20 min
    frontier-two-domain-goal-confirm-ewc) OMP_NUM_THREADS=1 forgetless bench --preset quick --seeds 3 --seed-start 3 \
                            --base-seeds 6 --workers 2 --methods 'full,ewc-distill[beta=0.5;mix=0.3;lam=300;lr=1e-3]' \
                            --out runs/goal-confirm-ewc   # ~15 min (~3 with bases 3-5 cached)
                        mkdir -p docs/figures/frontier-two-domain-goal-confirm-ewc
                        cp runs/goal-confirm-ewc/results.md docs/figures/frontier-two-domain-goal-confirm-ewc/ ;;
    frontier-two-domain-stdlib) python -c 'import sys; sys.version_info[:2] == (3, 11) or print("warning: python-stdlib is this interpreter'"'"'s standard library; RESULTS used Python 3.11.7 (another version measures another pair)")'
                        OMP_NUM_THREADS=1 forgetless bench --preset quick --seeds 3 --base-seeds 3 --domain-b python-stdlib \
                            --methods 'full,lora,adapter,neutral,ewc,apn-retrofit,neutral[mix=0],full[mix=0.1;lr=1e-4],full[mix=0.1],full[mix=0.1;lr=1e-3],ewc[mix=0.1;lr=1e-4],ewc[mix=0.1],ewc[mix=0.1;lr=1e-3],neutral[alpha=0],neutral[alpha=0;lr=3e-3]' \
                            --sweep full.lr=1e-4,1e-3 --sweep ewc.lr=1e-4,1e-3 --sweep lora.lr=3e-4,3e-3 \
                            --sweep adapter.lr=3e-4,3e-3 --sweep neutral.lr=3e-4,3e-3 --sweep apn-retrofit.lr=3e-4,3e-3 \
                            --out runs/frontier-two-domain-stdlib             # ~2 h (26 min of it pretraining three bases)
                        mkdir -p docs/figures/frontier-two-domain-stdlib
                        cp runs/frontier-two-domain-stdlib/{results.md,frontier.png,gates.png,routing_overlap.png} \
                            docs/figures/frontier-two-domain-stdlib/ ;;
    two-domain-quick)   OMP_NUM_THREADS=1 bench two-domain-quick --preset quick --methods all --seeds 3 --base-seeds 3 --workers 2 \
                            --sweep ffn.lr=1e-4,1e-3 --sweep apn-param-matched.lr=1e-4,1e-3 ;;
    tiny-renamed)       OMP_NUM_THREADS=1 bench tiny-renamed --preset quick --domain-a tinyshakespeare --domain-b renamed:tinyshakespeare \
                            --seeds 3 --base-seeds 3 --workers 2 --methods full,ffn,lora,apn,apn-local,apn-param-matched,apn-retrofit \
                            --sweep full.lr=1e-4,1e-3 --sweep ffn.lr=1e-4,1e-3 --sweep apn-param-matched.lr=1e-4,1e-3 --sweep apn.lr=1e-4,1e-3 ;;
    apn-ablation)       OMP_NUM_THREADS=1 bench apn-ablation --preset quick --seeds 3 --base-seeds 3 --workers 2 \
                            --methods 'apn,apn[local=true],apn[local=true;decoders_only=true],apn[norm_cap=0.1],apn[update_rule=gain;lr=0.03],apn[gate_on=router;gate_min=0.3],apn[gate_on=entropy;gate_max=2.0],apn[allocate=true],apn[allocate=true;novelty_threshold=0.34],apn[train_prototypes=false]' \
                            --sweep apn.lr=1e-4,1e-3 ;;
    two-domain-neutral) OMP_NUM_THREADS=1 bench two-domain-neutral --preset quick --seeds 3 --base-seeds 3 --workers 2 --methods 'full,ffn,lora,adapter,neutral,ewc,neutral[gate=none],neutral[gate=sigmoid],neutral[gate=none;alpha=0],neutral[mix=0],neutral[mix=0.01],neutral[mix=0.5],full[mix=0.01],full[mix=0.1],full[mix=0.5],lora[mix=0.1],adapter[mix=0.1]' ;;
    sequence-quick)     OMP_NUM_THREADS=1 bench sequence-quick --preset quick --protocol sequence --seeds 3 --base-seeds 3 \
                            --workers 2 --methods full,ffn,lora,adapter,moram,moe-lora,seq-lora ;;              # ~30 min
    frontier-sequence-replay) OMP_NUM_THREADS=1 bench frontier-sequence-replay --preset quick --protocol sequence --seeds 3 \
                            --base-seeds 3 --workers 2 --methods 'full[mix=0.1;lr=1e-4],full[mix=0.1],full[mix=0.1;lr=1e-3]' ;;  # ~12 min
    sequence-ablation)  OMP_NUM_THREADS=1 bench sequence-ablation --preset quick --protocol sequence --seeds 3 --base-seeds 3 --workers 2 --methods \
                            'moram[top_k=0;tau=1;delta=none],moram[tau=1;delta=none],moram[top_k=0;delta=none],moram[top_k=0;tau=1],moram[delta=none],moram' ;;
    two-domain-cms)     OMP_NUM_THREADS=1 bench two-domain-cms --preset quick --seeds 3 --base-seeds 3 --workers 2 \
                            --methods 'full,ffn,lora,adapter,cms,cms-fast,cms[periods=1,1,1,1],cms[accumulate=updates],cms[periods=1,1,1,1;lr=1e-4],cms[periods=1,1,1,1;lr=1e-3]' \
                            --sweep ffn.lr=1e-4,1e-3 --sweep cms.lr=1e-4,1e-3 ;;                      # ~45 min (32 of it 9 CMS bases)
    sequence-cms)       OMP_NUM_THREADS=1 bench sequence-cms --preset quick --protocol sequence --seeds 3 --base-seeds 3 --workers 2 \
                            --methods 'ffn,cms,cms-fast,cms[periods=1,1,1,1],cms[periods=1,1,1,1;lr=1e-3]' \
                            --sweep ffn.lr=1e-3 --sweep cms.lr=1e-3 ;;                                    # ~45 min (6 CMS bases)
    optimizers-quick)   OMP_NUM_THREADS=1 bench optimizers-quick --preset quick --optimizers adamw,muon,delta,deep,l2reg --workers 2 \
                            --lrs 3e-5,1e-4,3e-4,1e-3 --seeds 3 --pretrain-seeds 3 --base-seeds 3 ;;
    real-standard)      bench real-standard --model smollm2-135m --preset real --protocol sequence \
                            --tasks dbpedia,amazon,yahoo,agnews --seeds 1 \
                            --methods 'seq-lora,moram,o-lora,neutral,moram[lr=1e-3],seq-lora[mix=0.2],full,moram[lr=5e-3],ewc,moe-lora' ;;
    real-standard-seeds) bench real-standard-seeds --model smollm2-135m --preset real --protocol sequence \
                            --tasks dbpedia,amazon,yahoo,agnews --seeds 3 --methods 'seq-lora,moram[lr=5e-3]'   # ~2.5 h
                        forgetless bench --model smollm2-135m --preset real --protocol sequence \
                            --tasks dbpedia,amazon,yahoo,agnews --seeds 1 --methods 'seq-lora[lr=3e-4]' \
                            --out runs/real-standard-lora-lr                                                     # ~25 min
                        cp runs/real-standard-lora-lr/results.md docs/figures/real-standard-seeds/results-lora-lr.md ;;
    real-standard-replay) bench real-standard-replay --model smollm2-135m --preset real --protocol sequence \
                            --tasks dbpedia,amazon,yahoo,agnews --seeds 3 --methods 'seq-lora[mix=0.2]' ;;      # ~52 min
    real-standard-retrofits) bench real-standard-retrofits --model smollm2-135m --preset real --protocol sequence \
                            --tasks dbpedia,amazon,yahoo,agnews --seeds 1 --methods apn,cms ;;                 # ~45 min
    real-standard-neutral) bench real-standard-neutral --model smollm2-135m --preset real --protocol sequence \
                            --tasks dbpedia,amazon,yahoo,agnews --seeds 1 --seed-start 1 --methods neutral ;;  # ~30 min
    real-trace)         bench real-trace --model smollm2-135m --preset real --protocol sequence \
                            --tasks FOMC,ScienceQA,NumGLUE-cm,NumGLUE-ds --data-held-out-tasks dbpedia --seeds 1 \
                            --methods 'seq-lora,moram[lr=5e-3],seq-lora[mix=0.2]' ;;
    real-two-domain)    bench real-two-domain --model smollm2-135m --preset real --seeds 1 \
                            --methods full,lora,adapter,neutral,moram,apn,cms ;;
    real-two-domain-folio) bench real-two-domain-folio --model smollm2-135m --preset real --seeds 1 --domain-a pydoc-topics \
                            --domain-b shakespeare-folio --methods 'full,full[lr=1e-4],full[lr=2e-4],lora,lora[lr=3e-3],full[mix=0.1;lr=2e-4],distill[lr=2e-4],neutral,neutral[lr=3e-3]' ;;  # ~85 min
    real-neutral-pace)  PIN_NEUTRAL=0 forgetless bench --model smollm2-135m --preset real --seeds 1 --domain-a pydoc-topics \
                            --domain-b shakespeare-folio --methods 'full,lora,neutral[lr=1e-3]' --out runs/neutral-default-folio
                        forgetless adapt --model smollm2-135m --preset real --domain-a pydoc-topics \
                            --domain-b shakespeare-folio --method 'neutral[lr=3e-4]' --out runs/neutral-folio-lr3e-4
                        forgetless adapt --model smollm2-135m --preset real --domain-a pydoc-topics \
                            --domain-b python-stdlib --method 'neutral[lr=3e-4]' --out runs/neutral-python-lr3e-4
                        OMP_NUM_THREADS=1 PIN_NEUTRAL=0 forgetless bench --preset first --seeds 3 \
                            --methods 'neutral,neutral[normalize_input=false]' --out runs/neutral-norm-first ;;  # ~50 min
    study-standard)     forgetless study standard --model smollm2-135m --out runs/study-standard  # 56 arms: a GPU job (docs/results/real-models.md)
                        publish runs/study-standard study-standard ;;
    study-trace)        forgetless study trace --model smollm2-135m --order1-seeds 1 --out runs/study-trace
                        publish runs/study-trace study-trace ;;
    online-quick)       OMP_NUM_THREADS=1 bench online-quick --preset quick --protocol online --methods all --seeds 3 \
                            --base-seeds 3                                                                        # ~1.5 h
                        OMP_NUM_THREADS=1 forgetless bench --preset quick --protocol online --methods moram --seeds 3 \
                            --base-seeds 3 --out runs/online-moram                                              # ~10 min
                        OMP_NUM_THREADS=1 forgetless bench --preset quick --protocol online \
                            --methods 'hope,hope[writes=false]' --seeds 3 --out runs/online-hope                # ~15 min
                        cp runs/online-moram/results.md docs/figures/online-quick/results-moram.md
                        cp runs/online-hope/results.md docs/figures/online-quick/results-hope.md ;;
    hope-two-domain)    OMP_NUM_THREADS=1 bench hope-two-domain --preset quick --methods 'hope,hope[writes=false]' \
                            --seeds 3 ;;                                                                          # ~1.3 h
    hope-lm|hope-needle) OMP_NUM_THREADS=1 forgetless hope bench "${1#hope-}" --seeds 3 --out "runs/$1"       # ~50 / 35 min
                        publish "runs/$1" "$1"
                        if [ "$1" = hope-needle ]; then                                                           # ~25 min
                            OMP_NUM_THREADS=1 forgetless hope bench needle --seeds 1 --set budget_s=600 \
                                --set arms=gpt,titans --out runs/hope-needle-600
                            cp runs/hope-needle-600/results.md docs/figures/hope-needle/results-600s.md
                        fi ;;
    serve)              OMP_NUM_THREADS=2 python benchmarks/bench_serve.py --threads 2 --repeats 3 | tee runs/serve.log ;;  # alone
    hope-speed)         PYTHONPATH="${TITANS_DEPS:-/tmp/titans_deps}" OMP_NUM_THREADS=2 python benchmarks/bench_titans.py \
                            | tee runs/hope-speed.log ;;                        # alone; the peer: bench_titans.py's docstring
    first-run)          /usr/bin/time -v forgetless bench --out runs/first-run 2>&1 | tee runs/first-run.log
                        publish runs/first-run first-run ;;
    benchmarks)         for b in apn cms moram optim train scoring real harness; do
                            python "benchmarks/bench_$b.py" | tail -n 1; done | tee runs/benchmarks.jsonl ;;
    aunn)               forgetless aunn bench toy --out runs/aunn-toy
                        forgetless aunn bench shakespeare --out runs/aunn-shakespeare
                        forgetless aunn bench digits --out runs/aunn-digits
                        mkdir -p docs/figures/aunn
                        for s in toy shakespeare digits; do cp runs/aunn-$s/*.png docs/figures/aunn/; done ;;
    list)               printf '%s\n' "${SECTIONS[@]}" ;;
    *)                  echo "unknown section '$1'; valid: ${SECTIONS[*]} (or list)" >&2; exit 2 ;;
    esac
}

[ $# -gt 0 ] || { echo "usage: bash scripts/reproduce.sh SECTION [SECTION ...]; sections: ${SECTIONS[*]}" >&2; exit 2; }
for section in "$@"; do run_section "$section"; done
