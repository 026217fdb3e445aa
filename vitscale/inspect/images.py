"""The sample images the attention analyses look at: the first N readable images of a dataset split.

Read with the evaluation loader (dataset order, resize and centre crop, as the few-shot probe
reads), so the same dataset gives the same images every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vitscale.config.checks import ConfigError, positive_int
from vitscale.data.format import DatasetError


@dataclass
class SampleImages:
    """`pixels` uint8 (B, 3, R, R) and, per image, its sample key and a caption (its class)."""

    pixels: torch.Tensor
    keys: list[str]
    captions: list[str]


def sample_images(url: str, split: str, count: int, resolution: int, *,
                  endpoint_url: str | None = None) -> SampleImages:
    """The first `count` readable images of `split` (fewer if the split is smaller).

    Raises FileNotFoundError (no dataset at `url`) or ConfigError naming --split / --count.
    """
    from vitscale.data.format import has_dataset, no_dataset, read_meta
    from vitscale.data.loader.stream import ShardStream

    positive_int(count, "--count")
    if not has_dataset(url, endpoint_url=endpoint_url):
        raise FileNotFoundError(f"--images: {no_dataset(url, endpoint_url=endpoint_url)}")
    meta = read_meta(url, endpoint_url=endpoint_url)
    if split not in meta.splits:
        raise ConfigError("--split", f"{split!r} is not a split of {url} (splits: {sorted(meta.splits)})")
    samples = meta.samples(split)
    if samples == 0:
        raise ConfigError("--split", f"split {split!r} of {url} has no samples")
    # Bad samples are skipped however many there are (a budget of all of them): any `count` readable
    # images will do.
    stream = ShardStream(url, split, batch_size=min(count, samples), resolution=resolution, train=False,
                         num_workers=0, error_budget=1.0, endpoint_url=endpoint_url)
    pixels: list[torch.Tensor] = []
    keys: list[str] = []
    captions: list[str] = []
    for batch in stream:
        for i in torch.nonzero(batch["valid"]).flatten().tolist():  # refilled copies of bad samples: not twice
            if len(keys) == count:
                break
            label = batch["label"][i]
            cls = int(label.argmax()) if label.ndim else int(label)  # multi-hot: its first class
            name = meta.classes[cls] if cls < len(meta.classes) else f"class {cls}"
            pixels.append(batch["image"][i])
            keys.append(batch["key"][i])
            captions.append(f"{batch['key'][i]}\n{name}")
        if len(keys) == count:
            break
    if not keys:
        raise DatasetError(f"--images: no readable image in split {split!r} of {url}")
    return SampleImages(torch.stack(pixels), keys, captions)
