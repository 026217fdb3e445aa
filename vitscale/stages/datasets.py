"""The datasets stages read, made when missing and checked on the driver before Ray starts."""

from __future__ import annotations

from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.data.config import SourceConfig
from vitscale.say import say


def ensure_dataset(url: str, source: SourceConfig | None, endpoint_url: str | None, key: str) -> Any:
    """The dataset's metadata (`DatasetMeta`); writes the dataset first from `source` when absent.

    `key` is the config key that named `url` (e.g. "data.url"): errors name it.
    """
    from vitscale.data.format import has_dataset, no_dataset, read_meta
    from vitscale.data.tools.write import write_dataset

    if not has_dataset(url, endpoint_url=endpoint_url):
        if source is None:  # a setting that names nothing: the key (or the flag or --set it came from) is named
            raise ConfigError(key, no_dataset(url, endpoint_url=endpoint_url))
        say(f"writing {source.kind} dataset to {url}")
        write_dataset(source.kind, url, shard_size=source.shard_size, max_side=source.max_side,
                      quality=source.quality, seed=0, splits=dict(source.splits) if source.splits else None,
                      source_options=source.source_options(), endpoint_url=endpoint_url)
    return read_meta(url, endpoint_url=endpoint_url)


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
