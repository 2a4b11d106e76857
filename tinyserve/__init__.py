"""tinyserve: a tiny Llama and the small serving engine a course builds around it."""
from .checkpoint import load_model
from .config import PRESETS, ModelConfig
from .device import default_device, default_dtype
from .model import TinyLlama

__all__ = ["ModelConfig", "PRESETS", "TinyLlama", "default_device", "default_dtype",
           "load_model", "load_tokenizer"]


def load_tokenizer():  # type: ignore[no-untyped-def]
    """The shipped tokenizer (imported lazily: only text-facing code needs ``tokenizers``)."""
    from .tokenizer import load_tokenizer as _load
    return _load()
