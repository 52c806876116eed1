"""Data: your own (`load`, `mix`, `Collator`: data/user.py) and the benchmark's corpora and task streams."""
from forgetless.data.user import Collator, load, mix

__all__ = ["Collator", "load", "mix"]
