"""Few-shot probe of a model on sharded datasets: features once, then closed-form fits per shot count and seed.

The representation is `model.forward_features` (the pre-logits output when the model has that
layer), images are resized and centre-cropped to `fewshot.resolution`, and the least-squares maths is
`eval.fewshot` (Sec. 4.1 "Metrics" of the paper, as big_vision's few-shot evaluator does it). Rows the
stream refilled after a bad sample (`valid == False`) are dropped from both splits; the samples
skipped are counted in the result. Representations that are not finite (a model whose weights hold
NaN) are refused: their least-squares scores are NaN, and the argmax of those is chance.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vitscale.config.checks import ConfigError, check
from vitscale.config.errors import UserError
from vitscale.data.format import DatasetError
from vitscale.data.tools.progress import Progress
from vitscale.eval.config import FewshotConfig
from vitscale.eval.fewshot import extract_features, fewshot_accuracy


def probe_seeds(cfg: FewshotConfig) -> list[int]:
    """The seeds of the few-shot draws: `seed` .. `seed + seeds - 1` (big_vision: 0 .. num_seeds - 1)."""
    return list(range(cfg.seed, cfg.seed + cfg.seeds))


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation with ddof=1; 0.0 for a single value)."""
    if not values:
        raise ValueError("mean_and_std of no values")
    mean = math.fsum(values) / len(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def check_probe_dataset(meta: Any, url: str, cfg: FewshotConfig, key: str) -> None:
    """What a dataset's metadata (`DatasetMeta`) can tell before any image is read.

    Single-label, both splits present, and enough training examples for the largest shot count
    (whether every class has enough is known only from the labels: `sample_shots` says which does
    not). Raises `ConfigError` naming `key` (e.g. "fewshot.datasets[0]").
    """
    check(meta.labelled, key, f"{url} holds images without labels (num_classes 0); the few-shot probe needs "
                              "one label per image")
    check(not meta.multi_label, key, f"{url} is multi-label; the few-shot probe needs one label per image")
    for split, split_key in ((cfg.train_split, "fewshot.train_split"), (cfg.test_split, "fewshot.test_split")):
        if split not in meta.splits:
            raise ConfigError(split_key, f"{split!r} is not a split of {url} (splits: {sorted(meta.splits)})")
    train, most = meta.samples(cfg.train_split), max(cfg.shots)
    check(train >= most * meta.num_classes, "fewshot.shots",
          f"{most} shots x {meta.num_classes} classes need {most * meta.num_classes} examples; split "
          f"{cfg.train_split!r} of {url} has {train}")


def check_shots_per_class(url: str, num_classes: int, cfg: FewshotConfig, endpoint_url: str | None = None) -> None:
    """Every class of the probe's training split has `max(shots)` examples (from the index's labels).

    Otherwise the probe would fail only after pre-training (`sample_shots` refuses a short class).
    """
    import numpy as np
    import pyarrow.compute as pc

    from vitscale.data.format import read_index

    index = read_index(url, endpoint_url=endpoint_url).select(["split", "labels"])
    labels = pc.list_flatten(index.filter(pc.equal(index["split"], cfg.train_split))["labels"]).to_numpy()
    counts = np.bincount(labels[(labels >= 0) & (labels < num_classes)], minlength=num_classes)
    most = max(cfg.shots)
    short = np.flatnonzero(counts < most)
    if short.size:
        raise ConfigError("fewshot.shots", f"{most} shots of each class: class {int(short[0])} of split "
                                           f"{cfg.train_split!r} of {url} has only {int(counts[short[0]])} examples")


def check_probe_datasets(cfg: FewshotConfig, endpoint_url: str | None = None) -> None:
    """Every dataset of `cfg` exists and passes `check_probe_dataset` (FileNotFoundError / ConfigError)."""
    from vitscale.data.format import has_dataset, no_dataset, read_meta

    check(len(cfg.datasets) > 0, "fewshot.datasets", "needs at least one dataset to probe")
    for i, url in enumerate(cfg.datasets):
        key = f"fewshot.datasets[{i}]"
        if not has_dataset(url, endpoint_url=endpoint_url):
            raise FileNotFoundError(f"{key}: {no_dataset(url, endpoint_url=endpoint_url)}")
        check_probe_dataset(read_meta(url, endpoint_url=endpoint_url), url, cfg, key)


def _eval_stream(url: str, split: str, cfg: FewshotConfig, endpoint_url: str | None) -> Any:
    """All of `split`, in order, resized and centre-cropped (one rank: nothing is left out)."""
    from vitscale.data.loader.stream import ShardStream

    return ShardStream(url, split, rank=0, world_size=1, seed=cfg.seed, batch_size=cfg.batch_size,
                       resolution=cfg.resolution, train=False, num_workers=0, endpoint_url=endpoint_url,
                       error_budget=cfg.error_budget)


def _batches(stream: Any, device: torch.device,
             bar: Progress | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(images on `device` in [-1, 1], labels, valid): `extract_features` drops the rows not valid."""
    from vitscale.data.loader.transforms import normalize_on_device

    for batch in stream:
        if bar is not None:
            bar.update(int(batch["valid"].sum()))
        yield normalize_on_device(batch["image"].to(device)), batch["label"], batch["valid"]


def _features(model: torch.nn.Module, stream: Any, device: torch.device,
              progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from vitscale.data.loader.stream import ErrorBudgetExceeded

    try:
        with Progress(sum(stream.dataset.counts), f"features of {stream.spec.url} ({stream.spec.split})",
                      unit="img", enabled=progress) as bar:
            feats, labels = extract_features(model, _batches(stream, device, bar), device)
    except ErrorBudgetExceeded as exc:
        raise DatasetError(f"{stream.spec.url} ({stream.spec.split}): {exc} (fewshot.error_budget)") from exc
    # NaN features solve to NaN scores, whose argmax is class 0 for every image: chance, reported as an accuracy.
    bad = int((~torch.isfinite(feats)).any(dim=1).sum())
    if bad:
        raise UserError(f"{stream.spec.url} ({stream.spec.split}): the model's representations of {bad} of "
                        f"{feats.shape[0]} images are not finite (NaN or inf): its weights hold NaN or inf, or its "
                        f"activations overflow; no few-shot accuracy of them means anything")
    return feats, labels


def fewshot_probe(model: torch.nn.Module, cfg: FewshotConfig, *, endpoint_url: str | None = None,
                  device: torch.device | None = None, progress: bool = False) -> dict[str, Any]:
    """Few-shot accuracy of `model` on every dataset of `cfg.datasets`, for every shot count and seed.

    Returns (accuracies in [0, 1]):
        {dataset: {"5shot": mean over seeds, "5shot_std": std over seeds (ddof=1),
                   "5shot_seeds": [one accuracy per seed], ..., "chance": 1 / K,
                   "train_examples": N, "test_examples": M, "skipped": unreadable samples},
         "mean_5shot": mean over datasets of "5shot", ..., "seeds": [the seeds], "l2": ...}
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    seeds = probe_seeds(cfg)
    results: dict[str, Any] = {}
    for url in cfg.datasets:
        train_stream = _eval_stream(url, cfg.train_split, cfg, endpoint_url)
        if train_stream.dataset.multi_label:
            raise DatasetError(f"fewshot.datasets: {url} is multi-label; the few-shot probe needs one label per image")
        num_classes = train_stream.dataset.num_classes  # from dataset.json, not from the labels seen
        train_feats, train_labels = _features(model, train_stream, device, progress)
        test_stream = _eval_stream(url, cfg.test_split, cfg, endpoint_url)
        test_feats, test_labels = _features(model, test_stream, device, progress)
        per_shot: dict[str, Any] = {}
        for shots in cfg.shots:
            try:
                accuracies = [fewshot_accuracy(train_feats, train_labels, test_feats, test_labels,
                                               num_classes=num_classes, shots=shots, l2=cfg.l2, seed=seed)
                              for seed in seeds]
            except ValueError as exc:  # a class with too few readable examples: name the dataset
                raise DatasetError(f"{url} ({cfg.train_split}): {exc}") from exc
            mean, std = mean_and_std(accuracies)
            per_shot[f"{shots}shot"] = mean
            per_shot[f"{shots}shot_std"] = std
            per_shot[f"{shots}shot_seeds"] = accuracies
        per_shot["chance"] = 1.0 / num_classes
        per_shot["train_examples"] = int(train_labels.shape[0])
        per_shot["test_examples"] = int(test_labels.shape[0])
        per_shot["skipped"] = sum(train_stream.skipped().values()) + sum(test_stream.skipped().values())
        results[url] = per_shot
    for shots in cfg.shots:
        key = f"{shots}shot"
        results[f"mean_{key}"] = math.fsum(results[url][key] for url in cfg.datasets) / len(cfg.datasets)
    results["seeds"] = seeds
    results["l2"] = cfg.l2
    return results
