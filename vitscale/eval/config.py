"""The `fewshot` section: few-shot linear evaluation (Sec. 4.1), closed-form regularised least squares."""

from __future__ import annotations

from dataclasses import dataclass, field

from vitscale.config.checks import SEED_LIMIT, check, fraction, image_side, plain_name, positive, positive_int, seed
from vitscale.data.config import DEFAULT_ERROR_BUDGET, SourceConfig


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
    l2: float = 1024.0
    """Ridge strength of the least-squares fit, one fixed value (big_vision's `l2_reg = 2**10`)."""
    resolution: int = 224
    """Evaluation resolution (resize + centre crop)."""
    batch_size: int = 128
    """Images per forward pass during feature extraction."""
    seed: int = 0
    """First seed of the few-shot example draws: the draws use seeds `seed` .. `seed + seeds - 1`."""
    seeds: int = 3
    """Independent few-shot draws per dataset and shot count, reported as mean, std and per-seed
    values. 3 as in big_vision (`num_seeds`, seeds 0, 1, 2), so the numbers compare with its; each draw
    is one small solve on features extracted once, so more seeds cost almost nothing."""
    error_budget: float = DEFAULT_ERROR_BUDGET
    """Fraction of a probe split's samples that may be unreadable (skipped, never counted) before
    the probe fails naming the shards; as `data.error_budget`."""
    baseline: bool = False
    """Also probe the same architecture with its initial (untrained) weights, to show what training added."""

    def validate(self) -> None:
        check(len(set(self.datasets)) == len(self.datasets), "fewshot.datasets",
              f"lists a dataset twice: {list(self.datasets)}")
        check(len(self.shots) > 0, "fewshot.shots", "needs at least one shot count")
        for i, shots in enumerate(self.shots):
            positive(shots, f"fewshot.shots[{i}]")
        check(len(set(self.shots)) == len(self.shots), "fewshot.shots", f"lists a shot count twice: {list(self.shots)}")
        positive(self.l2, "fewshot.l2")
        image_side(self.resolution, "fewshot.resolution")
        positive(self.batch_size, "fewshot.batch_size")
        positive_int(self.seeds, "fewshot.seeds")
        check(self.seeds <= SEED_LIMIT, "fewshot.seeds",
              f"must be at most {SEED_LIMIT} (a seed each), got {self.seeds}")
        seed(self.seed, "fewshot.seed", count=self.seeds)  # the draws use seed .. seed + seeds - 1
        plain_name(self.train_split, "fewshot.train_split")
        plain_name(self.test_split, "fewshot.test_split")
        fraction(self.error_budget, "fewshot.error_budget")
        check(self.train_split != self.test_split, "fewshot.test_split",
              f"must differ from fewshot.train_split ({self.train_split!r}): the probe is tested on held-out data")
        if self.create_if_missing is not None:
            self.create_if_missing.validate("fewshot.create_if_missing")
