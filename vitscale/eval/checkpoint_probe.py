"""`vitscale fewshot CHECKPOINT --data SHARDS`: the few-shot probe of any checkpoint, in this process.

No Ray: the model runs on this machine's GPU (or CPU). What it reads (:func:`load_model`):

- a vitscale run directory or training checkpoint directory (the newest complete checkpoint,
  its ZeRO shards consolidated by `train/export.py`), probed at the size it was trained at;
- a vitscale export (``.pt`` / ``.pth`` / ``.safetensors`` with a vitscale header): rebuilt from
  its header; ``img_size`` rebuilds it at another size (position embeddings resampled);
- an official ``.npz`` or a timm state dict: the architecture is not in the file, so it needs
  ``model_name`` (``--model ViT-B/16``) and, unless 224, ``img_size`` (``--img-size``). The head's
  class count and a pre-logits layer are read from the file, so the representation is the one
  the file was trained with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitscale.config.location import is_url
from vitscale.eval.config import FewshotConfig
from vitscale.eval.probe import check_probe_datasets, fewshot_probe

DEFAULT_IMG_SIZE = 224


def _file_head(fmt: str, raw: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(classifier outputs, pre-logits width) stored in an npz / timm file; None where absent."""
    if fmt == "npz":
        raw = {k.removeprefix("ResNet/"): v for k, v in raw.items()}
        head = raw.get("head/kernel", raw.get("resnet/head/conv2d/kernel"))
        rep = raw.get("pre_logits/kernel")
        return (int(head.shape[-1]) if head is not None else None,
                int(rep.shape[-1]) if rep is not None else None)
    head = raw.get("head.weight", raw.get("head.fc.weight"))
    rep = raw.get("pre_logits.fc.weight")
    return (int(head.shape[0]) if head is not None else None,
            int(rep.shape[0]) if rep is not None else None)


def load_model(path: str | Path, *, model_name: str | None = None, img_size: int | None = None,
               resolution: int | None = None,
               model_options: Mapping[str, Any] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """(model with the checkpoint's weights, facts) from any checkpoint the probe reads (module docstring).

    Args:
        model_name: the architecture of an npz / timm file (a vitscale checkpoint names its own;
            given anyway, it must agree).
        img_size: the input size an npz / timm file was trained at (default 224; vitscale
            checkpoints know theirs; given anyway, it must agree).
        model_options: options of an npz / timm file's architecture (`create_model`'s keyword
            arguments, as a pipeline's `model:` section: depth, width, classifier, ...); vitscale
            checkpoints name their own.
        resolution: the size to probe at (default: the checkpoint's own). A ViT read from a file is
            built at it, its position embeddings resampled from the file's grid; a training
            checkpoint is probed only at its own size (`vitscale export` it first).

    Returns:
        facts: ``checkpoint`` (the file or checkpoint directory read), ``format`` ("run",
        "vitscale", "npz", "timm"), ``model`` (name), ``img_size`` (the size the model takes now),
        ``step`` (training step, runs only), ``notes`` (what loading changed: resampling, head).

    Raises:
        FileNotFoundError: no such file or directory, or a directory with no checkpoint.
        ValueError: an unreadable file, an npz/timm file without ``model_name``, a ``model_name`` or
            ``img_size`` that contradicts a vitscale checkpoint, weights that do not fit the model.
    """
    from vitscale.config.errors import UserError

    try:
        return _load_model(path, model_name=model_name, img_size=img_size, resolution=resolution,
                           model_options=dict(model_options or {}))
    except UserError:
        raise
    except ValueError as exc:
        # Reading a file the user named (models/checkpoints.py) or parsing a model name they typed:
        # the error is about that file or name, so it is theirs to fix and shown as one line.
        raise UserError("; ".join(line.strip() for line in str(exc).splitlines() if line.strip())) from exc


def _load_model(path: str | Path, *, model_name: str | None, img_size: int | None,
                resolution: int | None, model_options: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    from vitscale.models.checkpoints import load_pretrained, read_checkpoint
    from vitscale.models.factory import create_from_meta, create_model
    from vitscale.models.variants import parse_model_name

    def agree(what: str, given: Any, actual: Any, where: str) -> None:
        if given is not None and given != actual:
            raise ValueError(f"{where} is a {actual} {what}, not {given}; --model and --img-size are for "
                             "npz and timm files, which do not say")

    from vitscale.train.export import local_weights

    p = local_weights(path)  # a path as it is; from object storage, a local copy
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint file or run directory")
    if model_options and p.is_dir():
        raise ValueError(f"{p} is a run: it names its own model; --option is for npz and timm files")
    if p.is_dir():
        from vitscale.train.export import find_checkpoint, model_from_checkpoint

        checkpoint = find_checkpoint(p)
        model, _, facts = model_from_checkpoint(checkpoint)
        agree("model", model_name and parse_model_name(model_name).name, facts["model"], str(checkpoint))
        agree("pixel model", img_size, facts["img_size"], str(checkpoint))
        spec: Any = model.spec
        if resolution not in (None, facts["img_size"]) and spec.family != "resnet":
            raise ValueError(f"{checkpoint} takes {facts['img_size']}-pixel images, not --resolution {resolution}: "
                             f"the probe does not resample position embeddings of a training checkpoint; "
                             f"`vitscale export` it and probe the file with --resolution {resolution}")
        return model, {"checkpoint": str(checkpoint), "format": "run", "model": facts["model"],
                       "img_size": facts["img_size"], "step": facts["step"], "notes": []}

    try:
        fmt, raw, meta = read_checkpoint(p)
    except ValueError as exc:  # torch's unpickling errors run to several paragraphs: the first line says it
        raise ValueError(str(exc).splitlines()[0]) from exc
    if fmt == "vitscale":
        if model_options:
            raise ValueError(f"{p} is a vitscale export: it names its own model; --option is for npz and timm files")
        meta = dict(meta or {})
        agree("model", model_name and parse_model_name(model_name).name, meta.get("name"), str(p))
        agree("pixel model", img_size, meta.get("img_size"), str(p))
        del raw
        # Rebuilt at the probe's size: load_pretrained resamples the position embeddings.
        model = create_from_meta({**meta, "img_size": resolution or meta.get("img_size")})
    else:
        if model_name is None:
            raise ValueError(f"{p} is an {fmt} checkpoint without a vitscale header: name its architecture "
                             "with --model (e.g. --model ViT-B/16) and, unless 224, its input size with --img-size")
        spec = parse_model_name(model_name)
        num_classes, rep = _file_head(fmt, raw)
        del raw
        options: dict[str, Any] = {}
        if rep is not None and spec.family != "resnet":
            options["representation_size"] = rep  # probe the pre-logits the file was trained with
        model = create_model(spec.name, num_classes=num_classes or 1,
                             img_size=resolution or img_size or DEFAULT_IMG_SIZE, **{**options, **model_options})
    report = load_pretrained(model, p)
    built: Any = model  # create_model's plain attributes (spec, img_size), which nn.Module's typing hides
    return model, {"checkpoint": str(p), "format": fmt, "model": built.spec.name, "img_size": int(built.img_size),
                   "step": None, "notes": [*report.resampled, *report.notes]}


def fewshot_checkpoint(path: str | Path, fewshot: Mapping[str, Any], *, model_name: str | None = None,
                       img_size: int | None = None, endpoint_url: str | None = None,
                       device: torch.device | None = None, progress: bool = False,
                       model_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Probe the checkpoint at `path` on `fewshot["datasets"]`: what `vitscale fewshot` prints.

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
    cfg = dataclasses.replace(cfg, resolution=int(resolution or facts["img_size"]))
    results = fewshot_probe(model, cfg, endpoint_url=endpoint_url, device=device, progress=progress)
    return {**facts, "resolution": cfg.resolution, "results": results}


def _name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def fewshot_table(report: Mapping[str, Any]) -> str:
    """`fewshot_checkpoint`'s report as a text table: one row per dataset, mean±std per shot count."""
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
