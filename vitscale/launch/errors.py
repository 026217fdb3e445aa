"""Errors the launcher raises to the CLI. No Ray import here, so the CLI can catch them cheaply."""


class PipelineFailed(RuntimeError):
    """A stage failed on the cluster; the message names the failed ranks and their errors."""
