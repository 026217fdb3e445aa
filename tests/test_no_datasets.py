"""Ray Train's datasets callback (a `DatasetManager` actor at every worker-group start) is left out of a run that
hands Ray Train no dataset, and kept for one that does (launch/no_datasets.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from ray.train import ScalingConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from vitscale.launch.interruption import InterruptibleTrainer
from vitscale.launch.no_datasets import TrainerWithoutDatasets


def _names(trainer: TrainerWithoutDatasets) -> list[str]:
    return [type(callback).__name__ for callback in trainer._create_default_callbacks()]


def _range() -> object:
    import ray.data

    return ray.data.range(4)


def test_a_run_without_datasets_starts_no_dataset_manager_and_keeps_every_other_callback() -> None:
    from ray.train.torch import TorchTrainer

    def loop() -> None:
        pass

    plain = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1))
    lean = InterruptibleTrainer(loop, scaling_config=ScalingConfig(num_workers=1))
    ray_names = _names(plain)
    assert DatasetsCallback.__name__ in ray_names  # what Ray itself adds: the reason for the class
    assert _names(lean) == [name for name in ray_names if name != DatasetsCallback.__name__]

    # Handed a dataset (here a function that makes one, as Ray takes it), the trainer keeps Ray's callback:
    # `ray.train.get_dataset_shard` works as in Ray.
    given = InterruptibleTrainer(loop, scaling_config=ScalingConfig(num_workers=1), datasets={"train": _range})
    assert _names(given) == ray_names
