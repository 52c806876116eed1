"""User-facing errors: one line that names the problem and the fix."""
import importlib


class ForgetlessError(Exception):
    """Bad input or state. The CLI prints its message on one line and exits with code 2."""


def need(module: str, extra: str, what: str):
    """`module` imported, or a one-line ForgetlessError saying that `what` needs it and which extra of
    forgetless installs it (`pip install 'forgetless[EXTRA]'`). An optional package that is installed
    but fails to import for another reason (a missing dependency of its own) raises as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise
        raise ForgetlessError(f"{what} needs the {module.split('.')[0]} package: "
                              f"pip install 'forgetless[{extra}]'") from None
