"""The `data` section (what a training stage reads) and the source a missing dataset is written from.

Field names are the YAML keys: `data.url`, `data.create_if_missing.kind`, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vitscale.config.checks import (
    ConfigError,
    check,
    fraction,
    name_length,
    non_negative,
    plain_name,
    positive,
    seed,
)
from vitscale.config.fields import PATH, RESUME_FREE
from vitscale.config.location import canonical_location, endpoint_ok
from vitscale.data.order import DEFAULT_SHUFFLE_BUFFER
from vitscale.data.tools.source_base import MAX_DRAWN_CLASSES, MAX_DRAWN_IMAGES, MAX_DRAWN_SIDE
from vitscale.data.tools.sources import source_kind_of

DEFAULT_ERROR_BUDGET = 0.001
"""Share of a split's samples that may be unreadable and skipped (0.1%): the default of every reader
(`data.error_budget`, `fewshot.error_budget`, the loader's `ShardStream`, evaluation)."""

MAX_LOADER_WORKERS = 64
"""The most loader processes a rank may start (`data.num_workers`). One decodes about 690 images/s of 224-px
JPEGs (docs/gpu.md): 64 feed about 44,000 images/s, ten times ViT-B/16's 3,600 on an H200. Each holds its own
torch and decode buffers (a few hundred MB) and a DataLoader forks them all at once: a typo of 10,000 would
bring a node to a standstill before any error could name the key."""


def check_splits(splits: dict[str, float], key: str = "splits") -> None:
    """Named fractions of a source: names that can name shard files, fractions in (0, 1] summing to 1."""
    check(bool(splits), key, "must name at least one split, e.g. {train: 1.0}")
    for name, share in splits.items():
        check(bool(name) and all(c.isalnum() or c == "_" for c in name), key,
              f"split name {name!r} must be letters, digits or '_' (it names shard files)")
        name_length(name, key)
        positive(share, f"{key}.{name}")
        check(share <= 1.0, f"{key}.{name}", f"fraction {share} must be in (0, 1]")
    check(abs(sum(splits.values()) - 1.0) <= 1e-6, key,
          f"fractions must sum to 1, got {sum(splits.values()):.6g} ({splits})")


@dataclass(frozen=True)
class SourceConfig:
    """What `vitscale shards write` would be given; used to create a dataset that is absent."""

    kind: str = "synthetic"
    """A registered source (data/tools/sources.py): "synthetic", "fractal" (FractalDB-style IFS classes),
    "digits", "folder:PATH" (one folder per class), "list:FILE" (an image list), or a transfer
    dataset's distributed files: "cifar10:DIR", "cifar100:DIR", "pets:DIR", "flowers:DIR",
    "imagenet:DIR" (these bring their own splits)."""
    count: int = 2000
    """Number of images (synthetic and fractal only)."""
    classes: int = 10
    """Number of classes (synthetic and fractal only)."""
    image_size: int = 64
    """Side of generated images in pixels (synthetic and fractal only)."""
    multi_label: bool = False
    """Generate JFT-style multi-label samples (synthetic only)."""
    shard_size: int = 500
    """Samples per tar shard."""
    max_side: int = 384
    """Images are pre-resized so their longer side is at most this."""
    quality: int = 90
    """JPEG quality of the written shards."""
    splits: dict[str, float] | None = None
    """Named fractions carved reproducibly from the source, e.g. {train: 0.9, minival: 0.1}; null =
    the source's own splits (cifar10:, pets:, ...), else {train: 1.0}."""

    def validate(self, prefix: str) -> None:
        try:
            kind = source_kind_of(self.kind)
        except ValueError as exc:
            raise ConfigError(f"{prefix}.kind", str(exc)) from None
        for key in ("count", "classes", "image_size", "shard_size", "max_side"):
            positive(getattr(self, key), f"{prefix}.{key}")
        check(self.image_size <= MAX_DRAWN_SIDE, f"{prefix}.image_size",
              f"must be at most {MAX_DRAWN_SIDE} px, got {self.image_size}")
        check(self.classes <= MAX_DRAWN_CLASSES, f"{prefix}.classes",
              f"must be at most {MAX_DRAWN_CLASSES}, got {self.classes}")
        check(self.count <= MAX_DRAWN_IMAGES, f"{prefix}.count",
              f"must be at most {MAX_DRAWN_IMAGES:,}, got {self.count}")
        check(1 <= self.quality <= 95, f"{prefix}.quality", f"must be in [1, 95] (JPEG), got {self.quality}")
        # Off by default, so `true` was asked for: a source without the option would write one label per image.
        check(not self.multi_label or "multi_label" in kind.options, f"{prefix}.multi_label",
              f"{kind.name} writes one label per image; multi-label samples come from kind synthetic")
        if self.splits is not None:
            check(not kind.predefined_splits, f"{prefix}.splits",
                  f"{kind.name} has its own splits; leave splits out")
            check_splits(self.splits, f"{prefix}.splits")

    def source_options(self) -> dict[str, object]:
        """The options `open_source` takes for this kind (only the synthetic and fractal sources have any)."""
        if self.kind == "fractal":
            return {"count": self.count, "classes": self.classes, "image_size": self.image_size}
        if self.kind != "synthetic":
            return {}
        return {"count": self.count, "classes": self.classes, "image_size": self.image_size,
                "multi_label": self.multi_label}


@dataclass(frozen=True)
class DataConfig:
    url: str = field(default="data/synthetic", metadata=PATH)
    """Pre-training dataset: a local folder or s3://bucket/prefix of WebDataset shards."""
    split: str = "train"
    """Split of the dataset to pre-train on."""
    create_if_missing: SourceConfig | None = field(default=None, metadata=RESUME_FREE)
    """When set and `url` holds no dataset, write one from this source first (quickstart)."""
    endpoint_url: str | None = field(default=None, metadata=RESUME_FREE)
    """S3-compatible endpoint (MinIO, moto, ...); null = AWS or $AWS_ENDPOINT_URL."""
    num_workers: int = field(default=2, metadata=RESUME_FREE)
    """DataLoader worker processes per training rank (they parallelise reading, not the order)."""
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    """Bounded shuffle window in samples: memory stays flat however large the dataset."""
    seed: int = 0
    """Seed of the shard and sample order (which rank sees which sample, in which order)."""
    error_budget: float = field(default=DEFAULT_ERROR_BUDGET, metadata=RESUME_FREE)
    """Fraction of an epoch's samples (all ranks together) that may be corrupt or unreadable and
    skipped; one more stops the run at once, naming the shards. 0.001 = 0.1%, 1.0 = all of them
    (never stops), 0 = none. The count is kept in checkpoints: a restart goes on counting."""
    subset: int | None = None
    """Train on the first N samples of the split in a fixed permutation (the keyed hash of each
    sample's key with `data.seed`, `data/carve.py`): reproducible, and nested, as the paper's
    9M/30M/90M subsets of JFT-300M are (a smaller subset lies inside a larger one); null = all."""

    def validate(self, section: str = "data") -> None:
        """Check every value; errors name `section.key` (`finetune.data.url` in a fine-tuning job)."""
        s = section
        check(bool(self.url), f"{s}.url", "must name a folder or s3:// prefix")
        canonical_location(self.url, f"{s}.url")  # a malformed location (`s3:/bar`, a bad bucket) is refused here
        non_negative(self.num_workers, f"{s}.num_workers")
        check(self.num_workers <= MAX_LOADER_WORKERS, f"{s}.num_workers",
              f"at most {MAX_LOADER_WORKERS} loader processes per rank, got {self.num_workers} (each decodes about "
              "690 images/s: `vitscale shards bench` measures yours)")
        positive(self.shuffle_buffer, f"{s}.shuffle_buffer")
        seed(self.seed, f"{s}.seed")
        plain_name(self.split, f"{s}.split")  # it names shard files: {split}-NNNNNN.tar
        check(self.endpoint_url is None or endpoint_ok(self.endpoint_url), f"{s}.endpoint_url",
              f"must be an http:// or https:// URL of a host (e.g. http://minio:9000) or null, "
              f"got {self.endpoint_url!r}")
        fraction(self.error_budget, f"{s}.error_budget")
        positive(self.subset, f"{s}.subset")
        if self.create_if_missing is not None:
            self.create_if_missing.validate(f"{s}.create_if_missing")
