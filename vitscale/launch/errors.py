"""Errors the launcher raises to the CLI, and which errors the CLI shows as one line.

No Ray import here, so the CLI can catch them cheaply.
"""

from __future__ import annotations


class PipelineFailed(RuntimeError):
    """A stage failed on the cluster; the message names the failed ranks and their errors."""


def known_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix (a setting, the data, storage, a file, an argument): the CLI prints
    them as one line. Anything else is a bug or an unexpected failure and keeps its traceback."""
    from vitscale.config.checks import ConfigError
    from vitscale.config.errors import UserError
    from vitscale.data.format import DatasetError
    from vitscale.data.storage.base import StorageError

    return (ConfigError, UserError, DatasetError, StorageError, FileNotFoundError)
