"""forgetless: continual learning of Transformer language models without forgetting.

    import forgetless
    adapted = forgetless.attach(model, "neutral")   # any method, on our GPT or a transformers model
    adapted.save_pretrained("out/")
    adapted = forgetless.from_pretrained(model, "out/")
"""
__version__ = "0.1.0"

_LAZY = {"Adapted": "forgetless.adapted", "attach": "forgetless.adapted", "from_pretrained": "forgetless.adapted",
         "resolve_device": "forgetless.device", "METHODS": "forgetless.methods", "MethodSpec": "forgetless.methods",
         "method_names": "forgetless.methods", "register_method": "forgetless.methods",
         "ForgetlessCallback": "forgetless.hf_trainer", "ForgetlessWarning": "forgetless.adapted"}
__all__ = [*_LAZY, "data", "__version__"]


def __getattr__(name: str):
    """The public API, imported on first use (so that `forgetless --help` starts fast)."""
    if name == "data":
        import forgetless.data
        return forgetless.data
    if name not in _LAZY:
        raise AttributeError(f"module 'forgetless' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
