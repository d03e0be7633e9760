"""The one error type the converter reports to the user."""


class ConversionError(Exception):
    """A problem with the source or the options, reported as a one-line message without a traceback."""
