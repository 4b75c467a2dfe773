"""The policy and critic models (megatron-core): config, parallel setup, HF conversion,
tokenizers, generation with a KV cache, and dist_checkpointing checkpoints.

No module here imports megatron when imported: the functions that need it import it when
called, so `import hpc` works without megatron-core. See docs/policy.md.
"""
