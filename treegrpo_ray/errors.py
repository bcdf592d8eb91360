"""The one exception type for bad user input (configs, paths, data rows).

The CLI turns it into a one-line message and exit code 2; library callers catch it like a ValueError.
"""


class UserInputError(ValueError):
    """Bad input from the user: the message names what was wrong, the value seen and the fix."""
