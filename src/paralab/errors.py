"""Exceptions that carry a message for the user.

``UsageError`` means the input was wrong: the CLI prints the message and
exits with code 2 before any worker starts or any run directory exists.
"""


class UsageError(Exception):
    """Bad input; the message says what to change."""
