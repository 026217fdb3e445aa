"""The datasets stages read, made when missing and checked on the driver before Ray starts."""

from __future__ import annotations

import time
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.data.config import SourceConfig
from vitscale.say import say

BUSY_POLL_S = 2.0
"""How often a run waiting for another process's write of its dataset looks again."""


def ensure_dataset(url: str, source: SourceConfig | None, endpoint_url: str | None, key: str) -> Any:
    """The dataset's metadata (`DatasetMeta`); writes the dataset first from `source` when absent.

    When another process is writing that very dataset (two runs of one pipeline started together, a
    `shards write` to it), this one waits for it and reads what it wrote, as it reads any dataset already
    there; should that writer end without one (killed), this one writes it. Ctrl-C stops the wait.
    `key` is the config key that named `url` (e.g. "data.url"): errors name it.
    """
    from vitscale.data.format import has_dataset, no_dataset, read_meta
    from vitscale.data.storage.lease import LeaseHeld
    from vitscale.data.tools.write import write_dataset

    while not has_dataset(url, endpoint_url=endpoint_url):
        if source is None:  # a setting that names nothing: the key (or the flag or --set it came from) is named
            raise ConfigError(key, no_dataset(url, endpoint_url=endpoint_url))
        say(f"writing {source.kind} dataset to {url}")
        try:
            write_dataset(source.kind, url, shard_size=source.shard_size, max_side=source.max_side,
                          quality=source.quality, seed=0, splits=dict(source.splits) if source.splits else None,
                          source_options=source.source_options(), endpoint_url=endpoint_url)
        except LeaseHeld as busy:  # refused before it wrote anything
            if busy.holder is None:  # a live writer's folder around or inside this one: no end to wait for
                raise
            say(f"{url} is being written by {busy.holder}: waiting for it to finish")
            _wait_for_writer(url, endpoint_url)
    return read_meta(url, endpoint_url=endpoint_url)


def _wait_for_writer(url: str, endpoint_url: str | None) -> None:
    """Return once the writer holding `url`'s lease has ended (its dataset published, or it died): the lease is
    taken and given back every BUSY_POLL_S. Writing again to find out would open the source each time, and
    listing a folder of images (`folder:`, `imagenet:`) can take minutes."""
    from vitscale.data.storage.lease import LeaseHeld, hold_run_lease

    while True:
        time.sleep(BUSY_POLL_S)
        try:
            hold_run_lease(url, endpoint_url=endpoint_url, kind="dataset").release()
            return
        except LeaseHeld as held:
            if held.holder is None:  # a writer around or inside it meanwhile: said as any refusal is
                raise


def require_split(meta: Any, split: str, key: str, url: str) -> int:
    """Samples in `split` of the dataset at `url`; a `ConfigError` naming `key` when it has no such split."""
    if split not in meta.splits:
        raise ConfigError(key, f"{split!r} is not a split of {url} (splits: {sorted(meta.splits)})")
    return meta.samples(split)


def require_labels(meta: Any, key: str, url: str, needed_by: str) -> None:
    """A `ConfigError` naming `key` when the dataset at `url` has no labels (images alone, `num_classes` 0)."""
    if not meta.labelled:
        raise ConfigError(key, f"{url} holds images without labels (num_classes 0); {needed_by} needs labels "
                               "(images alone are for pre-training with train.objective: masked_patch)")
