"""forgetless: continual learning of Transformer language models without forgetting."""
__version__ = "0.1.0"
