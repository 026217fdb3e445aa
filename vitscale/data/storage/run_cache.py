"""Where a run stored in object storage keeps its node-local files (the cache `mirror.py` pushes from).

A run in `s3://` writes its records (config, logs, metrics, TensorBoard) into a folder on each node
and pushes them to its storage. That folder is

    <this node's runs cache root>/<run cache name>/<part>

- the *root* is resolved on the node that writes, never shipped from the driver: `$VITSCALE_RUNS_LOCAL`,
  else `~/vitscale-runs-local` of the user the node runs as, else (a home that user cannot create or
  write: a read-only image, a `$HOME` that does not exist) `<temp dir>/vitscale-runs-local-<uid>`;
- the *name* (`config/location.py`, `run_cache_name`) is the run's name and a hash of its canonical
  location and endpoint, computed once by the driver: two runs of one name in different buckets never
  share a folder, so neither can push its files into the other's storage;
- a *part* of the run (its fine-tuning, a sweep trial) is the same relative path in the cache as in the
  storage (`finetune`, `sweep/trials/<id>`): the cache's layout is the storage's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vitscale.config.location import run_cache_name
from vitscale.data.storage.s3 import resolve_endpoint_url

__all__ = ["ROOT_ENV", "run_cache_dir", "run_cache_key", "runs_cache_root"]

ROOT_ENV = "VITSCALE_RUNS_LOCAL"
"""Overrides where this node keeps the caches of object-storage runs."""


def runs_cache_root() -> Path:
    """This node's folder for the caches of object-storage runs, created and writable (see the module doc).

    Called on the node that writes: `~` is that node's user's home, not the driver's.
    """
    chosen = os.environ.get(ROOT_ENV)
    candidates = [Path(chosen).expanduser()] if chosen else []
    home = os.path.expanduser("~")
    if home != "~":  # no $HOME and no passwd entry: `~` stays as typed
        candidates.append(Path(home) / "vitscale-runs-local")
    candidates.append(Path(tempfile.gettempdir()) / f"vitscale-runs-local-{os.getuid()}")
    for candidate in candidates:
        if _usable(candidate):
            return candidate
    raise OSError(f"no writable folder for this node's run caches: tried {', '.join(map(str, candidates))}; "
                  f"set ${ROOT_ENV} to one")


def _usable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def run_cache_key(run_storage: str, endpoint_url: str | None = None) -> str:
    """The cache name of the run stored at `run_storage` (canonical) on `endpoint_url` (else this
    process's endpoint): what the driver ships to workers, who join it to their own root."""
    return run_cache_name(run_storage, resolve_endpoint_url(endpoint_url))


def run_cache_dir(cache_key: str, part: str = "") -> Path:
    """This node's folder for `part` of the run whose cache name is `cache_key`."""
    folder = runs_cache_root() / cache_key
    return folder / part if part else folder
