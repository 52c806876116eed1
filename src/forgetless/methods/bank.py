"""Methods that wrap target linears in a module growing per task (MoRAM atoms, MoE-LoRA experts).

The wrapper module has `add_task()` and lists of per-task tensors; attaching adds task 1's entries,
each later task adds its own, and only the newest entries (plus whatever `shared` names, e.g. a router)
train.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.nn as nn

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, default_linear_targets, find_modules, replace_module
from forgetless.nn.adapter import linear_shape


@dataclass
class BankConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "linear layers that get a bank (empty: as for LoRA, c_attn, c_proj, c_fc on the forgetless GPT, "
                "PEFT's default on a transformers model); all-linear for every linear"})


class GrowingBank(Method):
    default_for = ("sequence",)  # per-task banks; on one task (`--methods moram`) an adapter like others
    grows, unshardable = True, ""  # entries added after sharding stay whole (distributed.clip_grad_norm)
    module_cls: type[nn.Module]   # wrapper(base, d_in, d_out, cfg) with add_task()
    per_task: tuple[str, ...]     # its ParameterLists with one entry per task; the newest trains
    shared: tuple[str, ...] = ()  # its ParameterLists that train in full on every task

    def attach(self, model):
        rules = self.cfg.target_modules or default_linear_targets(model)
        for name, module in find_modules(model, rules, self.cfg.exclude_modules):
            shape = linear_shape(module)
            if shape is None:
                raise ForgetlessError(f"{self.name} wraps linear layers, but {name} is a {type(module).__name__}; "
                                      "target linears, e.g. c_attn,c_proj,c_fc")
            bank = self.module_cls(module, *shape, self.cfg)
            bank.add_task()
            replace_module(model, name, bank)
        return model

    def banks(self, model) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in model.named_modules() if isinstance(m, self.module_cls)]

    def on_task_start(self, model, task):
        """Task t trains the t-th entries: add them (task 1's came with attach)."""
        for _, bank in self.banks(model):
            while len(getattr(bank, self.per_task[0])) < task:
                bank.add_task()

    def trainable_parameters(self, model):
        out = []
        for prefix, bank in self.banks(model):
            for list_name in self.per_task:
                entries = getattr(bank, list_name)
                if len(entries):
                    out.append((f"{prefix}.{list_name}.{len(entries) - 1}", entries[-1]))
            for list_name in self.shared:
                out += [(f"{prefix}.{list_name}.{i}", p) for i, p in enumerate(getattr(bank, list_name))]
        return out

    def load_state_dict(self, model, tensors):
        """Grow each bank to the number of tasks in `tensors`, then load them: a subset of tasks
        1..n (e.g. a prefix of a saved sequence) rebuilds the model as it was after task n."""
        for prefix, bank in self.banks(model):
            pattern = re.compile(re.escape(f"{prefix}.{self.per_task[0]}.") + r"(\d+)$")
            n_tasks = 1 + max((int(m.group(1)) for k in tensors if (m := pattern.match(k))), default=-1)
            if len(getattr(bank, self.per_task[0])) > n_tasks:
                raise ForgetlessError(f"{prefix} already has more tasks than the saved state; attach to a fresh model")
            while len(getattr(bank, self.per_task[0])) < n_tasks:
                bank.add_task()
        super().load_state_dict(model, tensors)
