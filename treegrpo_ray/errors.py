"""Exceptions the CLI turns into one-line messages.

``UserInputError``: bad user input (configs, paths, data rows); exit code 2, and library callers
catch it like a ValueError. ``TrainingStopped``: a run that stopped itself for a reason it can name
(e.g. repeated non-finite losses), with what was saved; exit code 1.
"""


class UserInputError(ValueError):
    """Bad input from the user: the message names what was wrong, the value seen and the fix."""


class TrainingStopped(RuntimeError):
    """A run stopped itself: the message says why, what was kept and what to try."""
