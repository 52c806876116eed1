"""Full fine-tuning: the baseline every adaptation gain is measured against."""
from __future__ import annotations

from forgetless.methods.base import ALL, Method, register_method


@register_method("full")
class Full(Method):
    """Full fine-tuning: every parameter trains."""
    order, trains, injects, unshardable, prefix_once = 10, ALL, False, "", True

    def trainable_parameters(self, model):
        return list(model.named_parameters())
