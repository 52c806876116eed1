"""forgetless in transformers' `Trainer` (and TRL's `SFTTrainer`, which is one): a callback that starts
and ends the task, runs the method's step hooks, and keeps the method's state in Trainer checkpoints.

    adapted = forgetless.attach(model, "ewc-distill")
    trainer = Trainer(model=adapted, args=args, train_dataset=forgetless.data.mix(new, old),
                      data_collator=forgetless.data.Collator(tokenizer),
                      callbacks=[forgetless.ForgetlessCallback(adapted, previous=old)])
    trainer.train()                                  # or train(resume_from_checkpoint=True): exact resume
    adapted.save_pretrained("out/")

The loss Trainer optimises is `adapted(**batch).loss`: the LM loss plus the method's terms.
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from forgetless.adapted import Adapted, warn
from forgetless.checkpoint import load_checkpoint, save_checkpoint
from forgetless.errors import ForgetlessError
from forgetless.hooks import HookChain, module_hooks
from forgetless.train import TrainConfig

STATE_FILE = "forgetless_state.safetensors"  # inside each checkpoint-N folder: the method's loop state


class ForgetlessCallback(TrainerCallback):
    """Task start (EWC's Fisher on `previous`, the teacher snapshot) at the start of training, the method's
    before/after-step hooks around each optimizer step (with those of modules such as CMS levels), their
    state saved in each checkpoint and read back when training resumes from one, and the task's end
    when training ends. The weights themselves are in the Trainer's checkpoint."""

    def __init__(self, adapted: Adapted, previous=None, task: int | None = None):
        if not isinstance(adapted, Adapted):
            raise ForgetlessError(f"ForgetlessCallback takes the Adapted that forgetless.attach returned, "
                                  f"not a {type(adapted).__name__}")
        self.adapted, self.previous = adapted, previous
        self.task = task if task is not None else (adapted.task + 1 if adapted._started else adapted.task)
        self.modules = HookChain(module_hooks(adapted.model, adapted.trainable_parameters()))
        self.hooks = HookChain([adapted.method, self.modules])

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        adapted = self.adapted
        if state.global_step > 0:  # resumed: the method's state is the checkpoint's, not a fresh task start
            self.load(Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE_FILE)
        else:
            before = dict(adapted.trainable_parameters())
            adapted.start_task(self.task, self.previous)
            if optimizer is not None:
                follow_new_parameters(optimizer, before, adapted.trainable_parameters())
        lr = adapted.method.cfg.lr
        if lr is not None and lr != args.learning_rate and adapted._once("lr"):
            warn(f"{adapted.method.name}'s lr {lr:g} does not act in Trainer, which trains at learning_rate "
                 f"{args.learning_rate:g}; set TrainingArguments(learning_rate={lr:g}) to use it")
        own = adapted.method.make_optimizer(adapted.trainable_parameters(), TrainConfig(lr=args.learning_rate))
        if own is not None and adapted._once("optimizer"):
            warn(f"{adapted.method.name} trains with its own {type(own).__name__} in forgetless's loop; Trainer uses "
                 f"its own optimizer unless given optimizers=(optimizer, None), so results may differ from RESULTS")

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        done = state.global_step + 1
        self.hooks.before_step(self.adapted.model, optimizer, done, done == state.max_steps)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        done = state.global_step + 1
        self.hooks.after_step(self.adapted.model, optimizer, done, done == state.max_steps)

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            tensors = {**{f"hooks.{k}": v for k, v in self.adapted.method.hook_state().items()},
                       **{f"loop.{k}": v for k, v in self.modules.hook_state().items()}}
            save_checkpoint(Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE_FILE, tensors,
                            {"kind": "trainer-state", "method": self.adapted.method.name, "task": self.task,
                             "start_is_base": self.adapted._start_is_base})

    def on_train_end(self, args, state, control, **kwargs):
        self.adapted.end_task(self.task)

    def load(self, path: Path):
        """The method's loop state from a checkpoint (the task already started there)."""
        if not path.is_file():
            raise ForgetlessError(f"{path} does not exist: resume from a checkpoint written with ForgetlessCallback "
                                  "in the Trainer's callbacks")
        tensors, meta = load_checkpoint(path)
        if meta.get("method") != self.adapted.method.name:
            raise ForgetlessError(f"{path} holds the state of method {meta.get('method')}, not "
                                  f"{self.adapted.method.name}; resume with the method it was trained with")
        self.adapted.method.load_hook_state({k[6:]: v for k, v in tensors.items() if k.startswith("hooks.")})
        self.modules.load_hook_state({k[5:]: v for k, v in tensors.items() if k.startswith("loop.")})
        self.adapted.task, self.adapted._started = self.task, True
        self.adapted._start_is_base = bool(meta.get("start_is_base"))


def follow_new_parameters(optimizer, before: dict, after: list[tuple[str, object]]):
    """Trainer builds its optimizer before `on_train_begin`, so parameters a task start makes (OSF decomposes
    its layers again; growing banks add task t's entries) would never train: put each into the optimizer,
    in the group of the parameter it replaces (the one of the same name in `before`, whose state is dropped),
    else in the first group (Trainer's: the weight-decayed one)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    for name, p in after:
        if id(p) in group_of:
            continue
        old = before.get(name)
        group = group_of.get(id(old)) if old is not None else None
        if group is None:
            group = opt.param_groups[0]
        else:
            group["params"] = [q for q in group["params"] if q is not old]
            opt.state.pop(old, None)
        group["params"].append(p)
        group_of[id(p)] = group
