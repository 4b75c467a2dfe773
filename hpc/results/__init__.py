"""Evaluation records and training metrics, and their HDF5 schema (documented in results/SCHEMA.md)."""
