"""Verification: static policy checks of candidate source, and comparison of outputs."""
