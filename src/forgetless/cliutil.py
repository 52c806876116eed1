"""What the command-line apps share: one-line errors, config flags generated from dataclasses, their
merge with a config file and `--set` items, and the stdout console for tables."""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.markup import escape

from forgetless.config import field_types, help_of, load_file
from forgetless.errors import ForgetlessError
from forgetless.progress import console

# stdout, for tables; a log or pipe gets the 100 columns the tables are sized for (rich's default there is 80)
out_console = console.__class__(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 100)

HIDDEN_FIELDS = {"vocab_size", "ffn_options"}


def config_flags(sections: Callable[[], dict], panel: str = "config", covered: tuple[str, ...] = ()):
    """Decorator factory: one `--<section>-<field>` option per field of the dataclasses that
    `sections()` returns ({section: class}); the command receives them as `flags` ({section: {field: text}}).
    `covered`: "section.field" names the command takes under a shorter flag of its own (--domain-a for
    --data-domain-a): their long flags still work but leave the help, so it lists each setting once."""
    def decorate(fn):
        sig = inspect.signature(fn)
        extra = []
        for section, cls in sections().items():
            types = field_types(cls)
            for f in dataclasses.fields(cls):
                if f.name in HIDDEN_FIELDS:
                    continue
                flag = f"--{section}-{f.name.replace('_', '-')}"
                metavar = getattr(types[f.name], "__name__", "VALUE").upper()
                option = typer.Option(None, flag, help=help_of(f), metavar=metavar, show_default=False,
                                      rich_help_panel=f"{section} {panel}", hidden=f"{section}.{f.name}" in covered)
                extra.append(inspect.Parameter(f"{section}__{f.name}", inspect.Parameter.KEYWORD_ONLY,
                                               default=option, annotation=Optional[str]))
            for alias, name in getattr(cls, "aliases", {}).items():  # a field's earlier name still works
                option = typer.Option(None, f"--{section}-{alias.replace('_', '-')}", hidden=True,
                                      help=f"old name of --{section}-{name.replace('_', '-')}")
                extra.append(inspect.Parameter(f"{section}__{alias}", inspect.Parameter.KEYWORD_ONLY,
                                               default=option, annotation=Optional[str]))

        @functools.wraps(fn)
        def wrapper(**kwargs):
            flags: dict = {}
            for name in [k for k in kwargs if "__" in k]:
                value = kwargs.pop(name)
                if value is not None:
                    section, key = name.split("__", 1)
                    flags.setdefault(section, {})[key] = value
            return fn(flags=flags, **kwargs)

        params = [p for p in sig.parameters.values() if p.name != "flags"] + extra
        wrapper.__signature__ = sig.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper
    return decorate


def in_panel(option, panel: str):
    """A copy of a shared typer Option shown under the help panel `panel` of this command."""
    option = copy.copy(option)
    option.rich_help_panel = panel
    return option


def merge_overrides(config_file: Optional[Path], flags: dict, sets: Optional[list[str]] = None, into: tuple = (),
                    form: str = "KEY", example: str = "") -> dict:
    """Config file < `--<section>-<field>` flags < `--set FORM=VALUE` items, placed under the keys
    `into` + FORM split at dots (`lora.r=16` into ("methods",) -> {"methods": {"lora": {"r": "16"}}})."""
    overrides = load_file(config_file) if config_file else {}
    for section, values in flags.items():
        overrides.setdefault(section, {}).update(values)
    for item in sets or []:
        key, eq, value = item.partition("=")
        parts = key.split(".")
        if not (eq and all(parts)) or len(parts) != form.count(".") + 1:
            raise ForgetlessError(f"--set {item!r}: write {form}=VALUE, e.g. --set {example}")
        target = overrides
        for part in (*into, *parts[:-1]):
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return overrides


def friendly(fn=None, *, resume: str = ""):
    """One-line errors (exit 2) instead of tracebacks for bad input; on Ctrl-C (exit 130), `resume`
    says how to go on, for the commands that can (`@friendly(resume=...)`)."""
    if fn is None:
        return functools.partial(friendly, resume=resume)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ForgetlessError as e:  # escaped: messages name specs such as lora[r=16] or forgetless[aunn]
            console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            console.print("interrupted" + (f": {resume}" if resume else ""))
            raise typer.Exit(130)
    return wrapper
