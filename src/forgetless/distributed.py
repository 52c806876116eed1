"""Data parallelism over `torch.distributed` (launched by `torchrun` or `accelerate launch`), and FSDP.

Every rank draws the SAME global batch from the same seeded sampler and trains on its slice of rows;
after backward the gradients are averaged by hand (no DistributedDataParallel wrapper), so a parameter
that a rank's shard never reached (an unused APN patch, a frozen MoRAM atom) needs no
`find_unused_parameters` and any optimizer of `forgetless.optim` sees the global gradient. Each rank's
LM loss is weighted by its share of the batch's scored tokens, so the averaged gradient is the one a
single process computes on the whole batch. Files are written by rank 0 only. In one process every
function here is the identity (or a no-op).

`shard_model` adds FSDP (torch's `fully_shard`) for transformers models: each rank keeps 1/N of every
parameter, gradient and optimizer state (DTensors); FSDP averages the gradients of those, so the
hand-made averaging skips them, and `full` / `shard_as` turn them into whole tensors for files and back. Ranks
other than 0 may build the model on the meta device (`meta_unless_main`): `shard_model` fills their shards from
rank 0, and with bf16 precision FSDP2's mixed precision computes in bf16 and reduces gradients in fp32.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from forgetless.errors import ForgetlessError


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def init_from_env():
    """Join the process group when a launcher set WORLD_SIZE > 1 (gloo on CPU, nccl with one GPU per
    rank, chosen by LOCAL_RANK); ranks other than 0 print nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    atexit.register(leave)  # a process that exits with its group alive can abort in gloo's teardown
    if not is_main():
        from forgetless.progress import console
        console.quiet = True


def meta_unless_main():
    """A context in which ranks other than 0 build a model on the meta device (shapes, no weights) for
    `shard_model` to fill from rank 0; rank 0 (and one process) builds it as usual."""
    return torch.device("meta") if not is_main() else contextlib.nullcontext()


def leave():
    """Wait for every rank, close the process group, then give gloo's worker threads a moment (at exit).

    A gloo worker thread frees a finished collective only after waking the waiting thread, and a barrier's
    work holds every collective still in flight when it began (FSDP's all-gathers: tensors with Python
    objects). Freeing those needs the GIL; if the interpreter is already finalizing, the thread exits mid-
    destructor and the process aborts ("terminate called without an active exception", 1 run in ~10
    under load). Sleeping releases the GIL so the threads finish first; destroy_process_group does not
    join them (FSDP still holds the group)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.5)


def barrier():
    if world_size() > 1:
        dist.barrier()


def shard(batch):
    """(this rank's rows of the global `batch` (a data.splits.Batch; this module sits below data/), its share of the scored tokens * world size): the loss
    weight that makes the average of the ranks' gradients the global batch's gradient."""
    n = world_size()
    if n == 1:
        return batch, 1.0
    if len(batch.x) < n:
        raise ForgetlessError(f"batch size {len(batch.x)} is smaller than the {n} processes; "
                              "give a batch size of at least the number of processes")
    rows = torch.arange(len(batch.x), device=batch.x.device).tensor_split(n)[rank()]
    mine = type(batch)(batch.x[rows], batch.y[rows], batch.from_other[rows], None if batch.mask is None else batch.mask[rows])
    scored_all, scored_mine = (batch.y != -100).sum().item(), (mine.y != -100).sum().item()
    return mine, n * scored_mine / max(scored_all, 1)


def average(value: torch.Tensor) -> torch.Tensor:
    """Mean of `value` over the ranks."""
    if world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / world_size()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over the ranks (a new tensor, outside autograd)."""
    t = t.detach().clone()
    if world_size() > 1:
        dist.all_reduce(t)
    return t


def total(values: list[float], device: torch.device) -> list[float]:
    """Elementwise sum of `values` over the ranks (in float64)."""
    if world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def average_gradients(params: list[tuple[str, nn.Parameter]]):
    """Replace every gradient by its mean over the ranks, in one all-reduce per dtype. A parameter
    without a gradient on some rank counts zero there; one without a gradient on every rank keeps
    none (as in one process, where e.g. AdamW then skips it). FSDP shards (DTensors) are left alone:
    FSDP averaged their gradients in backward."""
    n = world_size()
    params = [p for _, p in params if not is_shard(p)]
    if n == 1 or not params:
        return
    device = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    dist.all_reduce(has)
    used = [p for p, h in zip(params, has.tolist()) if h > 0]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in {p.grad.dtype for p in used}:
        grads = [p.grad for p in used if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= n
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def broadcast_parameters(params: list[tuple[str, nn.Parameter]]):
    """Give every rank rank 0's values of `params` (the same start even if an initialisation differed);
    FSDP shards are skipped (`shard_model` gave them rank 0's values)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for _, p in params:
            if not is_shard(p):
                dist.broadcast(p.data, 0)


def shard_model(model: nn.Module, device: torch.device, precision: str = "fp32"):
    """FSDP: shard the parameters of a transformers `model` over the ranks, one group per decoder layer
    (the classes of its `_no_split_modules`) and one for the rest, from rank 0's values. A layer's
    whole weights exist only while it runs forward or backward. Ranks other than 0 may hold `model` on the meta
    device (built without weights): their shards are made on `device` and filled from rank 0 one tensor at a time,
    so no rank but 0 ever holds the whole model. `precision` bf16: FSDP2's mixed precision, weights gathered and
    computed in bf16 and gradients reduced in fp32, the shards (and AdamW) staying in their dtype."""
    check_shardable(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
    whole = model.state_dict() if is_main() else {}
    for module in list(model.modules()):
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for t in model.buffers():  # not sharded; some are in no state dict (rotary frequencies)
            dist.broadcast(t, 0)
        state = torch.get_rng_state()  # a rank built on meta drew no random numbers: later draws (a new task's
        dist.broadcast(state, 0)  # modules, LoRA's restart) must agree with rank 0's
        torch.set_rng_state(state)


def check_shardable(model: nn.Module | None):
    """Refuse FSDP for a model without decoder layers to shard by (None: not loaded yet), or in one process."""
    if model is not None and not getattr(model, "_no_split_modules", None):
        raise ForgetlessError(f"--fsdp shards transformers models by decoder layer and {type(model).__name__} names "
                              "none; use --model hf:PATH or smollm2-135m, or drop --fsdp")
    if world_size() == 1:
        raise ForgetlessError("--fsdp shards the model over several processes but this is one; launch with "
                              "torchrun --nproc_per_node N (or accelerate launch), or drop --fsdp")


def sharded(params: list[tuple[str, nn.Parameter]]) -> bool:
    """Whether FSDP shards any of `params`."""
    return any(is_shard(p) for _, p in params)


def is_shard(t) -> bool:
    """Whether `t` is an FSDP shard (a DTensor), without importing torch.distributed.tensor (about a second): a
    DTensor exists only once FSDP has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every FSDP shard gathered whole (on the CPU); every rank must call it, with the same keys."""
    return {k: v.full_tensor().cpu() if is_shard(v) else v for k, v in tensors.items()}


def gradients(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """d loss / d params (None where unused), as torch.autograd.grad. FSDP gathers a shard's whole weight outside
    autograd, so autograd.grad does not reach shards: where `params` holds some, a backward gives their gradients
    (averaged over the ranks, which must all call it with the same `loss`), leaving the params' .grad as it was."""
    if not any(is_shard(p) for p in params):
        return list(torch.autograd.grad(loss, params, allow_unused=True))
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    loss.backward()
    out = [p.grad for p in params]
    for p, grad in zip(params, kept):
        p.grad = grad
    return out


def gathered(t: torch.Tensor) -> torch.Tensor:
    """`t` whole, differentiably (an FSDP shard gathered from every rank, which must all call it); else `t`."""
    return t.full_tensor() if is_shard(t) else t


def shard_as(t: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """Whole tensor `t` sharded as `like` when that is an FSDP shard of t's shape; else `t`."""
    if is_shard(like) and t.shape == like.shape:
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(t.to(like.device), like.device_mesh, like.placements)
    return t


def clip_grad_norm(params: list[nn.Parameter], max_norm: float):
    """torch's clip_grad_norm_ over `params`, some of which may be FSDP shards and some whole tensors (a method's
    modules added after sharding, e.g. a growing bank's task-2 entries): one global norm, both kinds scaled by it."""
    groups = [[p for p in params if p.grad is not None and is_shard(p.grad) == kind] for kind in (True, False)]
    if not all(groups):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
    total = torch.stack([norms[0].full_tensor(), norms[1]]).norm()
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@contextlib.contextmanager
@torch.no_grad()
def whole(module: nn.Module):
    """Inside, the FSDP-sharded parameters of `module` (and its submodules) are whole plain tensors, e.g. to
    re-initialise them as one process does (a random init of a shard draws other numbers than the whole's slice);
    at exit every rank keeps its shard of the new values. Every rank must enter it, with the same RNG state."""
    shards = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if is_shard(p)]
    for m, name, p in shards:
        m._parameters[name] = nn.Parameter(p.full_tensor(), p.requires_grad)
    try:
        yield module
    finally:
        for m, name, p in shards:
            p.to_local().copy_(shard_as(m._parameters[name].data, p).to_local())
            m._parameters[name] = p
