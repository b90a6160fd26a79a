# A test's worker processes (multiprocessing's spawn imports tests.<module> to find their target) start as the
# product's do: asyncflow first, so that Megatron's import compiles nothing (asyncflow/_deferred_compile.py).
import asyncflow  # noqa: F401
