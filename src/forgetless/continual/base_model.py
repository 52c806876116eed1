"""Pretrained bases: train a GPT on domain A once per config and cache it by config hash."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.markup import escape

from forgetless.checkpoint import load_checkpoint, save_checkpoint
from forgetless.config import code_fingerprint, stable_hash
from forgetless.continual.evaluate import evaluate, module_stats
from forgetless.loss import training_loss
from forgetless.data.corpora import cache_dir
from forgetless.data.domains import Domain
from forgetless.data.splits import Sampler
from forgetless.data.tokenizers import tokenizer_from_dict
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.progress import console
from forgetless.train import PretrainConfig, train


def pretrain(model_cfg: GPTConfig, cfg: PretrainConfig, domain: Domain, tokenizer, out: Path,
             ckpt_path: Path | None = None, desc: str = "pretrain", device: torch.device | None = None) -> dict:
    """Train a fresh GPT on `domain` (initialised on the CPU, trained on `device`); write `out`
    (safetensors) and return its meta."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg).to(device or "cpu")
    sampler = Sampler(domain.train, cfg.batch_size, model_cfg.block_size, cfg.seed)
    run_config = {"model": model_cfg.to_dict(), "train": cfg.__dict__, "data": domain.fingerprint,
                  "tokenizer": tokenizer.to_dict()}
    t0 = time.perf_counter()
    history = train(model, list(model.named_parameters()), sampler, cfg, training_loss,
                    evaluate=lambda: {"ppl_a": evaluate(model, domain.windows, precision=cfg.precision)["ppl"],
                                      **module_stats(model, domain.windows)},
                    ckpt_path=ckpt_path, run_config=run_config, desc=desc)
    meta = {"kind": "base", "model_config": model_cfg.to_dict(), "tokenizer": tokenizer.to_dict(),
            "domain": domain.spec, "train_config": cfg.__dict__, "history": history.__dict__,
            "wall_s": time.perf_counter() - t0, "code": code_fingerprint()}
    save_checkpoint(out, {f"model.{k}": v for k, v in model.state_dict().items()}, meta)
    return meta


def load_base(path: Path) -> tuple[GPT, object, dict]:
    """(model, tokenizer, meta) from a base checkpoint written by `pretrain`."""
    tensors, meta = load_checkpoint(path)
    if meta.get("kind") != "base":
        raise ForgetlessError(f"{path} is a {meta.get('kind')!r} checkpoint, not a pretrained base; "
                              "give the file written by `forgetless pretrain`")
    model = GPT(GPTConfig(**meta["model_config"]))
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    return model, tokenizer_from_dict(meta["tokenizer"]), meta


def base_label(model_cfg: GPTConfig) -> str:
    """Short name of a base: its FFN kind, plus a hash of the FFN options when it has any."""
    return model_cfg.ffn + (f"-{stable_hash(model_cfg.ffn_options, 6)}" if model_cfg.ffn_options else "")


def cached_base(model_cfg: GPTConfig, cfg: PretrainConfig, domain: Domain, tokenizer,
                device: torch.device | None = None) -> Path:
    """Path of the cached base for this config, pretraining it first (resumably) if needed."""
    path = base_path(model_cfg, cfg, domain, tokenizer)
    folder = path.parent
    if path.exists():
        warn_if_other_code(load_checkpoint(path)[1].get("code"), f"cached base {folder}",
                           "delete that folder to pretrain it again")
    else:
        ckpt = folder / "training.safetensors"
        pretrain(model_cfg, cfg, domain, tokenizer, path, ckpt_path=ckpt, desc=f"pretrain {base_label(model_cfg)} base",
                 device=device)
        ckpt.unlink(missing_ok=True)
    return path


def base_path(model_cfg: GPTConfig, cfg: PretrainConfig, domain: Domain, tokenizer) -> Path:
    """Where the base of this config is cached (whether or not it exists yet)."""
    key = stable_hash({"model": model_cfg, "train": cfg, "data": domain.fingerprint,
                       "tokenizer": tokenizer.to_dict(), "windows": domain.windows.shape[0]})
    return cache_dir() / "bases" / f"{base_label(model_cfg)}-{key}" / "base.safetensors"


def warn_if_other_code(saved: str | None, what: str, fix: str):
    """One line on stderr when a reused result was made by other forgetless sources than these."""
    if saved != code_fingerprint():
        console.print(f"[yellow]warning:[/yellow] {escape(what)} was made by other forgetless code "
                      f"({saved or 'not recorded'}, now {code_fingerprint()}); {fix}", highlight=False, soft_wrap=True)
