"""The exception types the CLI prints as one line, no trace."""


class EmapgError(ValueError):
    """Bad input from the user: a config field, a path, a tensor argument."""


class DivergedError(EmapgError):
    """The run stopped itself: too many optimiser steps in a row were not finite (a result of the
    settings, which a study records as a diverged run, unlike every other error)."""
