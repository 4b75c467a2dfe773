"""Training-task synthesis (CUDA-Agent-Ops style): seed operators from torch, composed into
KernelBench tasks, filtered by running them, deduplicated and decontaminated (docs/synthesis.md).

catalog (operator specs), shapes (shape and range inference), context (what a chain under
construction declares, and the input families), compose (the seeded composer),
filters (the filter chain, with reasons), similarity (normalized ASTs, operator signatures),
manifest (HDF5 + JSONL manifest, per-filter statistics), ops6k (reading Ops-6K files), shards
(sharded resumable runs and the merge), config (the typed YAML config).
"""
