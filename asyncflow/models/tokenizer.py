"""The policy's tokenizer in a worker process, without ``AutoTokenizer``'s import.

``from transformers import AutoTokenizer`` imports transformers' auto-model machinery with it (torch's compiler
and distributed-tensor modules among them): about twice the CPU time of importing torch, paid by every process that
loads a tokenizer that way. The driver resolves the tokenizer's class once (``tokenizer_class``, on the tokenizer
it loaded with ``AutoTokenizer``); a worker given that class loads the same tokenizer from it (``load_tokenizer``):
the same class's ``from_pretrained`` on the same folder, which is what ``AutoTokenizer.from_pretrained`` calls.
"""

from __future__ import annotations

import importlib


def tokenizer_class(tokenizer) -> str | None:
    """The dotted path of ``tokenizer``'s class when transformers itself defines it (importable by name in any
    process), else None: a class from a model's own code (``trust_remote_code``) is found only through
    ``AutoTokenizer``."""
    cls = type(tokenizer)
    if not cls.__module__.startswith("transformers."):
        return None
    return f"{cls.__module__}.{cls.__qualname__}"


def load_tokenizer(model_dir: str, cls: str | None = None):
    """The tokenizer of ``model_dir``: ``cls.from_pretrained`` when ``cls`` names its class (``tokenizer_class``),
    else ``AutoTokenizer.from_pretrained``."""
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    module, _, name = cls.rpartition(".")
    return getattr(importlib.import_module(module), name).from_pretrained(model_dir)


def resolve_tokenizer_class(model_dir: str) -> str | None:
    """``tokenizer_class`` of ``model_dir``'s tokenizer as ``AutoTokenizer`` loads it (in the driver, which has
    loaded it already: the second load reads a few small files)."""
    return tokenizer_class(load_tokenizer(model_dir))
