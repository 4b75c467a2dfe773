"""Errors that reach the user as one line, never as a traceback."""


class UserError(Exception):
    """Bad input from the user (a task, candidate, config, file or argument): print and exit non-zero."""
