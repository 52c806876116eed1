"""Methods register themselves on import; importing this package makes all of them available."""
import importlib
import pkgutil

from forgetless.methods.base import (METHODS, Method, MethodConfig, MethodSpec, build_method, method_names,
                                     register_method)

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["METHODS", "Method", "MethodConfig", "MethodSpec", "build_method", "method_names", "register_method"]
