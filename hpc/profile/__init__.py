"""Profiling: the one timing protocol used for candidates and baselines alike."""
