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
    Advice("old data (a sample of what the model should keep), one domain or a stream of tasks", "lora",
           "20 % old rows: forgetless.data.mix(new, old, 0.2), adapt --retain",
           "SmolLM2-135M, 4-task stream, 3 seeds: BWT +14.7 points (95 % interval +7.1 to +22.3) over LoRA "
           "without replay, learning accuracy unchanged; replay did most of the work on every pair measured",
           "replay-on-three-seeds-sequential-lora-with-20--of-each-batch-from-the-earlier-tasks-2026-11-25"),
    Advice("old data, and the least forgetting at a given adaptation", "ewc-distill[beta=0.5;mix=0.3;lam=300;lr=1e-3]",
           "30 % old rows (the KL term acts on them) and previous=old for the Fisher",
           "byte-level GPT (0.84 M), one domain pair, 6 seeds: forgetting <= 2 % at adaptation >= 0.9; "
           "not yet run on a pretrained model",
           "toward-the-goal-distillation-on-replayed-rows-weight-averaging-and-combinations-2026-11-24"),
    Advice("old general text, a general-purpose model whose general perplexity must hold", "neutral",
           "10 % rows of the general text (its l1 term keeps the adapters silent on them)",
           "SmolLM2-135M, 4-task stream, 2 seeds: general perplexity +1.6 / +2.2 % where LoRA's rose 23-33 % "
           "(LoRA saw no general text); its tasks forget like LoRA's",
           "a-second-seed-for-neutral-residues-2026-11-25"),
    Advice("no old data, one new domain", "full[lr=5e-5]", "the new data only",
           "SmolLM2-135M, prose -> First Folio, 1 seed: forgetting -0.7 % at 5e-5, +4.8 % at 1e-4, +16.1 % at "
           "2e-4; LoRA (1e-3, 3e-3) was worse on both axes",
           "a-pair-where-fine-tuning-forgets-past-its-default-lr-general-prose--shakespeares-first-folio-on-"
           "smollm2-135m-2026-11-25-one-seed"),
    Advice("no old data, a stream of tasks, few trainable parameters", "moram[lr=5e-3]", "each task's data in turn",
           "SmolLM2-135M, 4-task stream, 3 seeds: BWT -5.1 +/- 4.3 vs LoRA's -17.8 +/- 2.0 (its lr chosen after "
           "seeing test scores); not distinguishable from replay, which needs old data",
           "seeds-1-and-2-sequential-lora-against-moramlr5e-3-2026-11-25"),
]


def advice_for(has_old_data: bool) -> Advice:
    """The first row for a user with (or without) old data: `forgetless adapt`'s default."""
    return GUIDE[0] if has_old_data else next(a for a in GUIDE if a.situation.startswith("no old data"))
