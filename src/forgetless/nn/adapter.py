"""Bottleneck adapter placed beside a sub-layer: out = sublayer(x) + up(act(down(x))).

Source: Houlsby et al., Parameter-Efficient Transfer Learning for NLP (ICML 2019).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BottleneckAdapter(nn.Module):
    """d -> bottleneck -> d with GELU; `up` starts at zero so attaching changes nothing."""

    def __init__(self, d: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(d, bottleneck)
        self.up = nn.Linear(bottleneck, d)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):  # (B, T, d)
        return self.up(F.gelu(self.down(x)))


class Beside(nn.Module):
    """Run `adapter` in parallel with the wrapped `base` module and add the outputs."""

    def __init__(self, base: nn.Module, adapter: nn.Module):
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x, *args, **kwargs):  # (B, T, d)
        out = self.base(x, *args, **kwargs)
        return out + self.adapter(x)


class SpanInput(nn.Module):
    """The first linear of an FFN span (FFNSpan): runs it and keeps its input, the FFN's input, for the span's
    last linear (SpanOutput) to give to the module beside the FFN."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.x: torch.Tensor | None = None
        self.lead: torch.Size | None = None  # leading shape of the layer's hidden states, e.g. (B, T)

    def see_layer(self, layer, args, kwargs):
        """Forward pre-hook of the span's layer: the leading shape of its hidden states (the layer may flatten
        them to (B*T, d) before its FFN, as OPT's does; the module beside the FFN gets (B, T, d) back)."""
        h = args[0] if args else kwargs.get("hidden_states")
        self.lead = h.shape[:-1] if torch.is_tensor(h) else None

    def forward(self, x, *args, **kwargs):
        self.x = x
        return self.base(x, *args, **kwargs)


class SpanOutput(Beside):
    """The last linear of an FFN span: its output plus `adapter` of the span's input (kept by `start`), which is
    what Beside adds beside an FFN that is a module of its own."""

    def __init__(self, base: nn.Module, adapter: nn.Module, start: SpanInput):
        super().__init__(base, adapter)
        self._start = [start]  # not a child: it is the layer's own (wrapped) first linear

    def forward(self, h, *args, **kwargs):
        start = self._start[0]
        x, lead = start.x, start.lead
        if x is None:
            raise RuntimeError(f"the FFN span's last linear ran before its first ({type(start.base).__name__}): "
                               "put the module beside the FFN module, or pass target_modules")
        start.x = None  # free the activation
        out = self.base(h, *args, **kwargs)
        if lead is not None and len(lead) > 1 and x.dim() == 2 and x.shape[0] == math.prod(lead):
            return out + self.adapter(x.view(*lead, x.shape[-1])).reshape(out.shape)
        return out + self.adapter(x)


class FFNSpan(nn.Module):
    """The FFN of a decoder layer that is no module of its own: its linears sit on the layer, which applies
    them in turn (OPT, XGLM, BioGPT: fc1 -> activation -> fc2). The span's first linear takes the FFN's
    input and its last gives the FFN's output (before dropout and the residual add), so "beside the FFN"
    means: keep the first linear's input x and add new(x) to the last linear's output (`put_beside`; x
    has the layer's (B, T, d) shape even where the layer flattens it). Not part of the model: its children
    are the layer's linears under their own names, so `f"{layer name}.{n}"` for n in its named_parameters()
    are the model's names (the `ffn` method trains them)."""

    def __init__(self, layer: nn.Module, names: list[str]):
        super().__init__()
        if len(names) < 2:
            raise ValueError("an FFN span needs a first and a last linear")
        self._layer = [layer]  # not a child: the span is a view of the layer
        for name in names:
            self.add_module(name, getattr(layer, name))
        self.first, self.last = names[0], names[-1]

    def forward(self, x):
        raise RuntimeError("an FFN span is a view of a layer's linears, not a module to run; use put_beside")

    def put_beside(self, new: nn.Module):
        """Add `new`(FFN input) to the FFN's output: the first linear keeps its input, the last adds new(x)."""
        layer = self._layer[0]
        start = SpanInput(getattr(layer, self.first))
        setattr(layer, self.first, start)
        setattr(layer, self.last, SpanOutput(getattr(layer, self.last), new, start))
        layer.register_forward_pre_hook(start.see_layer, with_kwargs=True)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(d_in, d_out) of an nn.Linear or a transformers Conv1D (GPT-2; weight is (in, out)), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D":
        return module.weight.shape[0], module.weight.shape[1]
    return None


def lora_pair(r: int, d_in: int, d_out: int, like: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """A new LoRA's (A (r, d_in) Kaiming-uniform, B (d_out, r) zero), on `like`'s device and dtype."""
    down = torch.empty(r, d_in, device=like.device, dtype=like.dtype)
    nn.init.kaiming_uniform_(down, a=math.sqrt(5))
    return nn.Parameter(down), nn.Parameter(torch.zeros(d_out, r, device=like.device, dtype=like.dtype))


def float_like(layer: nn.Module) -> torch.Tensor:
    """An empty tensor on `layer`'s device in the dtype it computes in: its first parameter's, or for a quantized
    layer (bitsandbytes 4/8-bit: packed integer weights) its compute dtype, else float32."""
    p = next(layer.parameters())
    if p.is_floating_point():
        return p.new_empty(0)
    return torch.empty(0, device=p.device, dtype=getattr(layer, "compute_dtype", None) or torch.float32)


def width_for(params_of, budget: float, least: int = 1) -> int:
    """The width n whose module has about `budget` parameters, for modules whose parameter count is
    linear in n: `params_of(n)` counts them (built at n = 1 and 2 only)."""
    one, two = params_of(1), params_of(2)
    return max(least, round((budget - (2 * one - two)) / (two - one)))


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def input_width(module: nn.Module) -> int:
    """Width d of the input of an FFN-like module: its first Linear or HF Conv1D, else (experts fused into
    3-D tensors, as Mixtral's) the input width of its first weight, in PyTorch's (out, in) layout (the router's)."""
    for m in module.modules():
        if shape := linear_shape(m):
            return shape[0]
    for p in module.parameters():
        if p.dim() >= 2:
            return p.shape[-1]
    raise ValueError(f"cannot tell the input width of {type(module).__name__}")
