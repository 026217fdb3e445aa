"""One object-storage endpoint for a whole run: dataset reads, checkpoints and the run's files.

vitscale reads datasets through boto3 (`data/storage/s3.py`), Ray Train writes checkpoints through
the `pyarrow.fs.S3FileSystem` vitscale hands it (`data/storage/filesystem.py`), and the run's files
and lease go through boto3 again. All of them resolve the endpoint the same way
(`resolve_endpoint_url`): an explicit URL, else `$VITSCALE_S3_ENDPOINT_URL`, else `$AWS_ENDPOINT_URL`.

A pipeline's `data.endpoint_url` is made *the* endpoint of the run by :func:`run_endpoint`: while the
run lasts the driver's `$VITSCALE_S3_ENDPOINT_URL` is set to it, and :func:`endpoint_env` is what the driver passes to
every Ray worker it starts (`ray.init(runtime_env=...)`), so a MinIO user's checkpoints go to MinIO,
not to AWS. Credentials are never passed this way (they would show in Ray's job records): every node
gets them from its own environment or pod identity.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from vitscale.config.checks import ConfigError
from vitscale.data.storage.retry import RETRY_ENV
from vitscale.data.storage.s3 import ENDPOINT_ENV_VARS

__all__ = ["SHARED_VARS", "endpoint_env", "run_endpoint"]

SHARED_VARS = (*ENDPOINT_ENV_VARS, "AWS_REGION", "AWS_DEFAULT_REGION", RETRY_ENV)
"""What every process of a run must agree on to reach the same store and give up on it alike (no
credentials)."""


@contextlib.contextmanager
def run_endpoint(endpoint_url: str | None, key: str = "data.endpoint_url") -> Iterator[str | None]:
    """While the block runs, `endpoint_url` (the pipeline's `key`) is this process's endpoint for every
    object-storage client; yields the endpoint in force (None: AWS's own).

    None leaves the environment's choice. A different `$VITSCALE_S3_ENDPOINT_URL` already set is a
    ConfigError naming both: one run, one store. The environment is restored afterwards, so runs one
    after another in one process (a notebook, the tests) do not inherit each other's store.
    """
    var = ENDPOINT_ENV_VARS[0]
    current = os.environ.get(var)
    if endpoint_url is None:
        yield current or os.environ.get(ENDPOINT_ENV_VARS[1]) or None
        return
    if current and current.rstrip("/") != endpoint_url.rstrip("/"):
        raise ConfigError(key, f"{endpoint_url} differs from ${var}={current}: datasets, checkpoints and the "
                          "run's files use one endpoint; set one of them")
    os.environ[var] = endpoint_url
    try:
        yield endpoint_url
    finally:
        if current is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = current


def endpoint_env() -> dict[str, str]:
    """The environment every Ray worker of the run gets: endpoint and region, as this driver has them."""
    return {name: os.environ[name] for name in SHARED_VARS if os.environ.get(name)}
