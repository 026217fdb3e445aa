"""The error a user fixes that names no config key: a command-line argument, a file that is not what it
should be. The CLI prints it (like `ConfigError`) as one line; other exceptions keep their traceback."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user gave cannot work as given; the message says what and how to fix it."""
