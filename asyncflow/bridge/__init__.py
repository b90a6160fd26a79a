"""Weight bridge: Megatron shards (TP/PP/EP) <-> Hugging Face <-> vLLM tensor-parallel layout.

See docs/bridge.md. Names and splits live in ``hf_layout``; shard plans in ``shards`` and
``vllm_layout``; the loop's weight path in ``buckets`` (fused-group-safe buckets), ``staging`` (trainer
ranks stage their shards in shared memory, vLLM workers read their own boxes) and ``sync``; checkpoint
conversion in ``checkpoint`` (CLI: ``tools/convert_checkpoint.py``).
"""
