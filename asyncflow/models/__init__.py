"""Model facts and builders shared by the layers above: ``arch`` (``GPTArch``, no dependencies),
``megatron`` (Megatron-core ``GPTModel`` builder), ``parallel`` (process-group set-up), ``device``
(the one place that decides an engine's device).

The bridge and the engines both import from here; nothing here imports them.
"""
