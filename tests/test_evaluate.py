"""Accuracy on an evaluation set: a damaged test split fails past the job's error budget, never
scores silently over what happens to be readable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.datasets import write_test_dataset
from vitscale.data.loader.stream import ErrorBudgetExceeded
from vitscale.models import create_model
from vitscale.train.evaluate import accuracy
from vitscale.train.job import EvalSet


def test_a_damaged_test_split_is_refused_past_the_budget(tmp_path: Path) -> None:
    def corrupt(key: str, sample: dict[str, bytes]) -> dict[str, bytes]:
        if key.startswith("test") and int(key[-2:]) % 4 == 0:  # a quarter of the test split
            sample["jpg"] = sample["jpg"][:100] + b"\x00" * 50
        return sample

    write_test_dataset(tmp_path / "d", {"test": [24]}, num_classes=3, size=(20, 16), hook=corrupt)
    torch.manual_seed(0)
    model = create_model("ViT-Ti/16", num_classes=3, img_size=16, depth=1).eval()
    test = EvalSet("test", str(tmp_path / "d"), "test")
    kwargs = {"resolution": 16, "batch_size": 8, "device": torch.device("cpu"), "dtype": torch.float32}
    with pytest.raises(ErrorBudgetExceeded):
        accuracy(model, test, error_budget=0.1, **kwargs)
    score = accuracy(model, test, error_budget=0.5, **kwargs)  # 18 readable samples of 24
    assert 0.0 <= score <= 1.0 and (score * 18).is_integer()
