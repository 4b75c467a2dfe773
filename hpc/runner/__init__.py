"""Code that runs INSIDE sandboxed worker processes (reference, candidate, eager, torch.compile).

Never imported by the harness process itself: it loads task and candidate code.
"""
