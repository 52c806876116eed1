"""User-facing errors: one line that names the problem and the fix."""


class ForgetlessError(Exception):
    """Bad input or state. The CLI prints its message on one line and exits with code 2."""
