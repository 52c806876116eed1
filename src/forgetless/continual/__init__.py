"""The protocols (docs/DESIGN.md §3) and what they share; `protocols()` is their registry by name."""
import importlib
import pkgutil


def protocols() -> dict:
    """Name -> Protocol, by name, after importing this package's modules (the protocols register themselves)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    from forgetless.continual.protocol import PROTOCOLS
    return dict(sorted(PROTOCOLS.items()))
