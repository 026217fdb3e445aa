"""Where things live: the one test for "is this a URL", and the one rule for where a run is stored.

Every location in a pipeline (a dataset, `cluster.storage_path`, a checkpoint) is either a local
path or a URL with a scheme (`s3://bucket/prefix`, `file:///...`). Code that must tell them apart
asks `is_url`; code that needs a run's place asks `run_location`.
"""

from __future__ import annotations

import os
from pathlib import Path


def is_url(location: str) -> bool:
    """Whether `location` is a URL with a scheme (`s3://...`, `file://...`), not a local path."""
    return "://" in location


def storage_root(storage_path: str) -> str:
    """`cluster.storage_path` as every node must read it: a URL as written, a local path made absolute."""
    if is_url(storage_path):
        return storage_path.rstrip("/")
    return str(Path(os.path.expanduser(storage_path)).resolve())


def run_location(storage_path: str, run_name: str) -> str:
    """Where the run `run_name` keeps its checkpoints and results: `storage_path/run_name`."""
    return f"{storage_root(storage_path)}/{run_name}"
