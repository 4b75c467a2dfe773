"""Verification: static checks of candidate source against the evaluator's rules, and comparison of outputs."""
