"""Published results printed beside a study's own rows, as reference points: other models, other scales, often
other task sets; never a like-for-like comparison. Each row names its model, its tasks and where the number is
from. Only numbers found in the project's sources are listed (the brief that asked for the study, the MoRAM
source in seeds/); none is derived here except a sign: BWT is shown with the GEM sign (< 0 = forgetting), so a
published positive drop d appears as -d.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

BRIEF = ("the field's table of this stream (mean accuracy over O-LoRA's 3 orders; O-LoRA: Wang et al., 2023, "
         "arXiv:2310.14152), as the study's brief quotes it")
MORAM = "the MoRAM source (shared/seeds/001), TRACE table; its BWT column is a drop (> 0 = forgetting)"
OSF = "PEFT's OSF example, as the study's brief quotes it"


@dataclass(frozen=True)
class Reference:
    stream: str
    model: str
    method: str
    op: float            # average accuracy (%) after the last task
    bwt: float | None    # GEM sign; None: not given
    tasks: str           # what the number was measured on
    source: str


REFERENCES = [
    *[Reference("standard", "T5-large", method, op, None, "standard CL benchmark, 4 tasks, 3 orders", BRIEF)
      for method, op in (("SeqFT", 28.5), ("SeqLoRA", 43.7), ("O-LoRA", 75.8), ("MTL", 80.0))],
    *[Reference("standard", "LLaMA-2-7B-chat", method, op, None, "standard CL benchmark, 4 tasks, 3 orders", BRIEF)
      for method, op in (("SeqLoRA", 76.0), ("O-LoRA", 77.2), ("InfLoRA", 79.6), ("MTL", 80.9))],
    *[Reference("trace", model, method, op, -drop, "TRACE, the source's 8 tasks", MORAM)
      for model, rows in (("LLaMA-2-7B-Chat", (("SeqLoRA", 34.3, 18.5), ("EWC", 42.36, 5.97), ("O-LoRA", 42.78, 7.16),
                                                ("MoRAM", 44.54, 1.37))),
                          ("LLaMA-3-1B-Instruct", (("SeqLoRA", 29.73, 17.03), ("EWC", 31.96, 11.62),
                                                    ("O-LoRA", 32.94, 12.89), ("MoRAM", 37.77, 3.12))))
      for method, op, drop in rows],
    *[Reference("trace", "Llama-3.1-8B", method, op, None, "three TRACE tasks", OSF)
      for method, op in (("full fine-tuning", 46.3), ("OSF", 53.4))],
]


def references(stream: str) -> list[dict]:
    """The published rows for `stream` (standard, trace; none for a stream written out)."""
    return [asdict(r) for r in REFERENCES if r.stream == stream]
