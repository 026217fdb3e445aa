"""A TorchTrainer that starts no Ray Data actor when it is handed no Ray Dataset.

Ray Train V2 (2.60) adds its datasets callback to every run, datasets or not. At each start of a worker group
(the first attempt, every restart, every sweep trial's run) the callback starts a `DatasetManager` actor: a
process of its own that imports Ray Data, to hand the workers shards of the datasets the trainer was given.
vitscale's workers read their WebDataset shards themselves (`data/`) and give Ray Train no dataset, so that
actor serves nothing; it cost 2.4 CPU-seconds of every start, measured on a 2-core machine against a whole
tiny run's 40.

The callback is left out only while the trainer has no dataset (`ray.train.get_dataset_shard` would then find
no provider, and vitscale's workers never call it). Should a later Ray rename or move the callback, nothing is
left out and runs start as Ray makes them.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

_DATASETS: type | None
try:  # Ray's internal class: when it is gone, every callback stays (see above)
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback as _DATASETS
except ImportError:  # pragma: no cover -- another Ray
    _DATASETS = None

__all__ = ["TrainerWithoutDatasets"]


class TrainerWithoutDatasets(TorchTrainer):
    """``TorchTrainer`` whose runs start no `DatasetManager` actor while it has no dataset."""

    def _create_default_callbacks(self) -> list[Any]:
        # Train V2's hook; the type stubs Ray ships are the V1 class's.
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        if self.datasets or _DATASETS is None:
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, _DATASETS)]
