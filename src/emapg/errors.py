"""The one exception type for user error: the CLI prints its message as one line, no trace."""


class EmapgError(ValueError):
    """Bad input from the user: a config field, a path, a tensor argument."""
