"""Which method, when: what a user has -> the method and settings the measured evidence supports, each
with the scale it was measured at and its section of docs/RESULTS.md. `forgetless methods` prints it,
`forgetless adapt` takes its default method from it, and the README shows it."""
from __future__ import annotations

from dataclasses import dataclass

RESULTS = "docs/RESULTS.md"


@dataclass(frozen=True)
class Advice:
    situation: str  # what the user has and wants
    method: str     # a method spec (`forgetless adapt --method`, `forgetless.attach`)
    data: str       # what goes into the batches
    evidence: str   # what was measured, at what scale
    anchor: str     # its section of docs/RESULTS.md


GUIDE = [
    Advice("old data (a sample of what the model should keep), one domain or a stream of tasks", "seq-lora",
           "20 % old rows: forgetless.data.mix(new, old, 0.2), adapt --retain",
           "SmolLM2-135M-Instruct, 4-task stream, 3 seeds: BWT +14.7 points (95 % +7.1 to +22.3) over the same LoRA "
           "without replay, learning accuracy -0.2 (-3.3 to +3.0); seed-only intervals on 50 test rows per task; "
           "general-text perplexity still rose 24.6 % (replaying tasks does not protect general text). For one "
           "domain seq-lora and lora are the same",
           "replay-on-three-seeds-sequential-lora-with-20--of-each-batch-from-the-earlier-tasks-2026-11-25"),
    Advice("old data, and the least forgetting at a given adaptation", "ewc-distill[beta=0.5;mix=0.3;lam=300]",
           "30 % old rows (the KL term acts on them) and previous=old for the Fisher",
           "byte-level GPT (0.84 M), one spelling pair, 200 steps, at lr 1e-3 (the byte GPT's; on a pretrained model "
           "it starts at 5e-5, untested there); beta, mix, lam and lr chosen in 7 rounds of search on these windows: "
           "on 3 fresh bases forgetting 1.04 % at adaptation 0.923 held out, 1.55 % on validation (every seed < 2 %); "
           "over all 6 seeds 2 are above 2 % on validation. Re-tune on your own validation rows",
           "ewc-with-distillation-and-apn-local-with-replay-2026-11-25"),
    Advice("old general text, a general-purpose model whose general perplexity must hold", "neutral",
           "10 % rows of the general text (an l1 term on the adapters' output acts on them); lr 3e-4 on a "
           "pretrained model (the real presets and adapt --data set it; in Trainer set learning_rate=3e-4)",
           "SmolLM2-135M-Instruct, prose -> First Folio, 1 seed, lr chosen there on validation windows: adapts at "
           "LoRA's pace (G 0.671 vs 0.627), old-text perplexity -3.3 % where LoRA's rose 0.7 %, but it replays old "
           "rows (LoRA did not) and trains 58x LoRA's parameters; on a 4-task stream (2 seeds, before its input "
           "scaling and lr were set) general perplexity +1.6 / +2.2 % where LoRA's rose 23-33 %, its tasks "
           "forgetting like LoRA's; the gates open on old text too",
           "neutral-residues-at-loras-pace-on-a-pretrained-model-input-scale-and-lr-2026-11-26-one-seed"),
    Advice("no old data, one new domain", "full[lr=5e-5]", "the new data only",
           "SmolLM2-135M-Instruct, prose -> First Folio, 1 seed, 32 steps of batch 8 (longer training untested), "
           "18 held-out windows of the old text: forgetting -0.7 % at 5e-5, +4.8 % at 1e-4, +16.1 % at 2e-4; LoRA "
           "(1e-3, 3e-3) was worse on both axes",
           "a-pair-where-fine-tuning-forgets-past-its-default-lr-general-prose--shakespeares-first-folio-on-"
           "smollm2-135m-2026-11-25-one-seed"),
    Advice("no old data, a stream of tasks, few trainable parameters", "moram[lr=5e-3]", "each task's data in turn",
           "SmolLM2-135M-Instruct, 4-task stream, 3 seeds: BWT -5.1 +/- 4.3 vs LoRA's -17.8 +/- 2.0 (its lr chosen "
           "after seeing test scores; LoRA at its default lr only); learning accuracy not resolved (-1.7, -15.5 to "
           "+12.2); not distinguishable from replay, which needs old data; grows 460,800 parameters per task",
           "seeds-1-and-2-sequential-lora-against-moramlr5e-3-2026-11-25"),
]


def advice_for(has_old_data: bool) -> Advice:
    """The first row for a user with (or without) old data: `forgetless adapt`'s default."""
    return GUIDE[0] if has_old_data else next(a for a in GUIDE if a.situation.startswith("no old data"))
