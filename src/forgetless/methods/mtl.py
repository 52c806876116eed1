"""mtl: the multi-task ceiling of a task sequence, full fine-tuning on all tasks' training rows mixed.

The sequence protocols (continual/sequence.py, continual/instruct.py) train an arm whose config sets
`joint` once, on the rows of every task together, for as many steps as the sequential arms take over the
whole sequence, then score every task; `mtl` is `full[joint=true]`, and `METHOD[joint=true]` is the joint
arm of any other method (e.g. `seq-lora[joint=true]` for a LoRA ceiling). Outside a sequence it is full
fine-tuning (the two-domain and online protocols refuse joint arms).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from forgetless.methods.base import MethodConfig, register_method
from forgetless.methods.full import Full


@dataclass
class MTLConfig(MethodConfig):
    joint: bool = field(default=True, metadata={
        "help": "learn all tasks at once (the point of mtl; false makes it `full`)"})


@register_method("mtl")
class MTL(Full):
    """Full fine-tuning, trained jointly on all tasks of a sequence (the multi-task upper reference)."""
    Config = MTLConfig
    order = 71
    default_for = ()  # named only: `--methods all` (and the tables it reproduces) stay as they were
