"""Where one Ray Train run of a pipeline run lives: its location in storage, and its folder on the node that asks.

No Ray here: the driver computes a run's place from the config (`run_place`) and ships it to the workers,
which find their own node's folder from it (`RunPlace.local_dir`).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

from vitscale.config.location import is_url, part_location
from vitscale.config.pipeline import ClusterConfig
from vitscale.data.storage.run_cache import run_cache_dir, run_cache_key

__all__ = ["RunPlace", "run_place"]


@dataclass(frozen=True)
class RunPlace:
    """Where one Ray Train run of a pipeline run lives: in storage, and on whichever node asks.

    A pipeline run's Train runs all live inside it (`storage_path/run_name/<part>`: the pretraining at
    the run itself, `finetune`, `sweep/trials/<id>`, ...), never beside it. On object storage each node
    keeps its files in its own cache folder (`data/storage/run_cache.py`), found from `cache_key` on
    that node: the driver ships the key, not a path of its own disk.
    """

    storage: str
    """This Train run's canonical location: a shared folder or an `s3://` prefix."""
    cache_key: str | None
    """The pipeline run's node-local cache name; None when the storage is a folder every node reads."""
    part: str = ""
    """This Train run's path inside the pipeline run ("" for the run itself)."""

    @property
    def name(self) -> str:
        """The Train run's name (the last segment of its location: the run's name, `finetune`, a trial id)."""
        return posixpath.basename(self.storage)

    @property
    def label(self) -> str:
        """The pipeline run's name and this Train run's part inside it (`vit-b16`, `vit-b16/finetune`,
        `vit-b16/sweep/trials/<id>`): its metrics' `run` label, which `name` alone (`finetune`, `final`) would
        give every pipeline's fine-tuning alike."""
        depth = len(self.part.strip("/").split("/")) if self.part.strip("/") else 0
        return "/".join(self.storage.rstrip("/").split("/")[-1 - depth:])

    def local_dir(self) -> Path:
        """This node's folder for the run: the storage itself, or this node's cache of it (its root created)."""
        if self.cache_key is None:
            return Path(self.storage)
        return run_cache_dir(self.cache_key, self.part)

    def sub(self, part: str) -> RunPlace:
        """The Train run at `part` inside this one (a sweep's trials inside `sweep/trials`)."""
        inner = posixpath.join(self.part, part) if self.part else part
        return RunPlace(part_location(self.storage, part), self.cache_key, inner)

    def ray_storage(self) -> tuple[str, str]:
        """(`RunConfig.storage_path`, `RunConfig.name`): Ray Train stores the run at their join."""
        return posixpath.dirname(self.storage), self.name


def run_place(cluster: ClusterConfig, run_name: str, part: str = "") -> RunPlace:
    """Where the run `run_name` (or its `part`) lives: `cluster.run_storage(run_name)` is the one rule
    (config/location.py), and an object-storage run's node cache is keyed by that location and the
    endpoint in force, never by the name alone."""
    storage = cluster.run_storage(run_name)
    cache = run_cache_key(storage) if is_url(storage) else None
    place = RunPlace(storage, cache)
    return place.sub(part) if part else place
