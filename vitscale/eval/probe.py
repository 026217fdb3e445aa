"""Few-shot probe of a model on a sharded dataset: features once, then one closed-form fit per shot count.

The representation is `model.forward_features` (the pre-logits output when the model has that
layer), images are resized and centre-cropped to `fewshot.resolution`, and the least-squares maths is
`eval.fewshot` (Sec. 4.1 "Metrics" of the paper).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from vitscale.eval.config import FewshotConfig
from vitscale.eval.fewshot import extract_features, fewshot_accuracy


def _eval_stream(url: str, split: str, cfg: FewshotConfig, endpoint_url: str | None) -> Any:
    """All of `split`, in order, resized and centre-cropped (one rank: nothing is left out)."""
    from vitscale.data.loader.stream import ShardStream

    return ShardStream(url, split, rank=0, world_size=1, seed=cfg.seed, batch_size=cfg.batch_size,
                       resolution=cfg.resolution, train=False, num_workers=0, endpoint_url=endpoint_url)


def _batches(stream: Any, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from vitscale.data.loader.transforms import normalize_on_device

    for batch in stream:
        yield normalize_on_device(batch["image"].to(device)), batch["label"]


def fewshot_probe(model: torch.nn.Module, cfg: FewshotConfig, *, endpoint_url: str | None = None,
                  device: torch.device | None = None) -> dict[str, Any]:
    """Few-shot accuracy of `model` on every dataset of `cfg.datasets`, for every shot count.

    Returns {dataset: {"5shot": accuracy, ...}, "mean_<k>shot": ...} with accuracies in [0, 1].
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    results: dict[str, Any] = {}
    for url in cfg.datasets:
        train_stream = _eval_stream(url, cfg.train_split, cfg, endpoint_url)
        if train_stream.dataset.multi_label:
            raise ValueError(f"fewshot.datasets: {url} is multi-label; the few-shot probe needs one label per image")
        num_classes = train_stream.dataset.num_classes  # from dataset.json, not from the labels seen
        train_feats, train_labels = extract_features(model, _batches(train_stream, device), device)
        test_feats, test_labels = extract_features(
            model, _batches(_eval_stream(url, cfg.test_split, cfg, endpoint_url), device), device)
        per_shot = {}
        for shots in cfg.shots:
            per_shot[f"{shots}shot"] = fewshot_accuracy(
                train_feats, train_labels, test_feats, test_labels, num_classes=num_classes, shots=shots,
                l2=cfg.l2, seed=cfg.seed)
        per_shot["chance"] = 1.0 / num_classes
        results[url] = per_shot
    for shots in cfg.shots:
        key = f"{shots}shot"
        results[f"mean_{key}"] = sum(r[key] for r in results.values() if isinstance(r, dict)) / len(cfg.datasets)
    return results
