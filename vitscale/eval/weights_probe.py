"""`vitscale fewshot WEIGHTS --data SHARDS`: the few-shot probe of any weights, in this process.

No Ray: the model runs on this machine's GPU (or CPU). It reads whatever `train/weights.py`
(:func:`~vitscale.train.weights.load_model`) reads: a run or training checkpoint (probed at the size
it was trained at), a vitscale export, an official ``.npz`` or a timm state dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vitscale.config.location import is_url
from vitscale.eval.config import FewshotConfig
from vitscale.eval.probe import check_probe_datasets, fewshot_probe
from vitscale.train.weights import load_model


def fewshot_weights(path: str | Path, fewshot: Mapping[str, Any], *, model_name: str | None = None,
                       img_size: int | None = None, endpoint_url: str | None = None,
                       device: torch.device | None = None, progress: bool = False,
                       model_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Probe the weights at `path` on `fewshot["datasets"]`: what `vitscale fewshot` prints.

    `progress` shows each split's feature extraction (images, rate, ETA) on stderr.

    Args:
        fewshot: fields of the `fewshot:` section (`FewshotConfig`): datasets, shots, seeds, l2, ...;
            without `resolution` (or with None) the probe runs at the checkpoint's own input size.
        model_name, img_size: the architecture of an npz / timm file (see :func:`load_model`).

    Returns:
        The facts of :func:`load_model`, ``resolution``, and ``results`` (:func:`fewshot_probe`'s
        dict: per dataset the mean, std and per-seed accuracy of every shot count).

    Raises:
        FileNotFoundError / ValueError (ConfigError): a missing dataset or checkpoint, a bad value,
            a multi-label dataset, too few examples for the shots, a resolution the model cannot take.
    """
    if not is_url(str(path)) and not Path(path).expanduser().exists():  # one in storage is checked when read
        raise FileNotFoundError(f"{path}: no such checkpoint file or run directory")
    options = {k: v for k, v in fewshot.items() if v is not None}
    resolution = options.pop("resolution", None)
    cfg = FewshotConfig(**options)
    cfg.validate()
    if resolution is not None:
        dataclasses.replace(cfg, resolution=resolution).validate()
    check_probe_datasets(cfg, endpoint_url)  # before a large model is read
    model, facts = load_model(path, model_name=model_name, img_size=img_size, resolution=resolution,
                              model_options=model_options)
    cfg = dataclasses.replace(cfg, resolution=int(facts["img_size"] if resolution is None else resolution))
    results = fewshot_probe(model, cfg, endpoint_url=endpoint_url, device=device, progress=progress)
    return {**facts, "resolution": cfg.resolution, "results": results}


def _name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def fewshot_table(report: Mapping[str, Any]) -> str:
    """`fewshot_weights`'s report as a text table: one row per dataset, mean±std per shot count."""
    results = report["results"]
    datasets = [k for k, v in results.items() if isinstance(v, dict)]
    shots = [k for k in results[datasets[0]] if k.endswith("shot")]
    header = ["dataset", *shots, "chance", "train", "test", "skipped"]
    rows = []
    for url in datasets:
        r = results[url]
        rows.append([_name(url), *(f"{r[k]:.3f}±{r[k + '_std']:.3f}" for k in shots), f"{r['chance']:.3f}",
                     str(r["train_examples"]), str(r["test_examples"]), str(r["skipped"])])
    if len(datasets) > 1:
        rows.append(["mean", *(f"{results['mean_' + k]:.3f}" for k in shots), "", "", "", ""])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             .rstrip() for row in [header, *rows]]
    step = f", step {report['step']}" if report.get("step") is not None else ""
    seeds = results["seeds"]
    intro = [f"{report['checkpoint']} ({report['format']}, {report['model']} at {report['img_size']}{step})"]
    intro += [f"  note: {note}" for note in report.get("notes", [])]
    outro = (f"top-1 accuracy, mean±std over {len(seeds)} seed(s) {seeds}; ridge l2 {results['l2']:g}; "
             f"resolution {report['resolution']}")
    return "\n".join([*intro, *lines, outro])
