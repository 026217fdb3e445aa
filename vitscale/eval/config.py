"""The `fewshot` section: few-shot linear evaluation (Sec. 4.1), closed-form regularised least squares."""

from __future__ import annotations

from dataclasses import dataclass, field

from vitscale.config.checks import check, non_negative, positive
from vitscale.data.config import SourceConfig


@dataclass(frozen=True)
class FewshotConfig:
    """Which datasets to probe, with how many examples per class, at which resolution."""

    datasets: tuple[str, ...] = field(default=(), metadata={"path": True})
    """Datasets to probe (folders or s3:// prefixes with train and test splits)."""
    create_if_missing: SourceConfig | None = None
    """Write the (first) probe dataset from this source when it is absent (quickstart: digits)."""
    train_split: str = "train"
    """Split the few-shot examples are drawn from."""
    test_split: str = "test"
    """Split accuracy is reported on."""
    shots: tuple[int, ...] = (1, 5, 10, 25)
    """Examples per class."""
    l2: float = 1.0
    """Ridge regularisation of the least-squares fit."""
    resolution: int = 224
    """Evaluation resolution (resize + centre crop)."""
    batch_size: int = 128
    """Images per forward pass during feature extraction."""
    seed: int = 0
    """Seed of the few-shot example draw."""
    baseline: bool = False
    """Also probe the same architecture with its initial (untrained) weights, to show what training added."""

    def validate(self) -> None:
        check(len(self.shots) > 0, "fewshot.shots", "needs at least one shot count")
        for i, shots in enumerate(self.shots):
            positive(shots, f"fewshot.shots[{i}]")
        non_negative(self.l2, "fewshot.l2")
        positive(self.resolution, "fewshot.resolution")
        positive(self.batch_size, "fewshot.batch_size")
        non_negative(self.seed, "fewshot.seed")
        check(self.train_split != self.test_split, "fewshot.test_split",
              f"must differ from fewshot.train_split ({self.train_split!r}): the probe is tested on held-out data")
        if self.create_if_missing is not None:
            self.create_if_missing.validate("fewshot.create_if_missing")
