"""Method modules as plain nn.Modules; importing this package registers their FFN kinds."""
import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
