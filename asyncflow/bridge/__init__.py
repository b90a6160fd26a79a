"""Weight bridge: Megatron shards (TP/PP/EP) <-> Hugging Face <-> vLLM tensor-parallel layout.

See docs/bridge.md. Names and splits live in ``hf_layout``; shard plans in ``shards`` and
``vllm_layout``; streaming sync in ``buckets``, ``transport``, ``sync`` and ``weight_sync``; checkpoint
conversion in ``checkpoint`` (CLI: ``tools/convert_checkpoint.py``).
"""
