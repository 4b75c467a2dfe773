"""Evaluation records and their one HDF5 schema (documented in results/SCHEMA.md)."""
