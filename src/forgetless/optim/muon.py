"""Several optimizers stepped as one (e.g. Muon on hidden matrices + AdamW on the rest)."""
from __future__ import annotations

import torch


class Chained(torch.optim.Optimizer):
    """One optimizer over disjoint parts, each handled by its own optimizer. `param_groups` are the
    parts' groups (so a learning-rate schedule reaches all of them); state_dict numbers the parameters
    across parts like a single optimizer would, so checkpoints save and resume it unchanged."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        self.defaults = {}

    @property
    def param_groups(self):  # read anew: a part's load_state_dict replaces its group dicts
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self):
        return {p: s for part in self.parts for p, s in part.state.items()}

    def step(self, closure=None):
        loss = self.parts[0].step(closure)  # a closure recomputes the gradients once, for every part
        for part in self.parts[1:]:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        state, groups, offset = {}, [], 0
        for part in self.parts:
            sd = part.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [offset + i for i in g["params"]]})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups, offset = iter(state_dict["param_groups"]), 0
        for part in self.parts:
            mine = [next(groups) for _ in part.param_groups]
            count = sum(len(g["params"]) for g in mine)
            part.load_state_dict({
                "state": {i - offset: s for i, s in state_dict["state"].items() if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine]})
            offset += count
