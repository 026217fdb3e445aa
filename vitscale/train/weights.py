"""Any weights a user has, as a model on this machine: `vitscale fewshot`'s and `vitscale inspect`'s reader.

What it reads (:func:`load_model`):

- a vitscale run directory or training checkpoint directory (the newest complete checkpoint,
  its ZeRO shards consolidated by `train/export.py`), at the size it was trained at; a run or
  checkpoint in object storage is read from a local copy;
- a vitscale export (``.pt`` / ``.pth`` / ``.safetensors`` with a vitscale header): rebuilt from
  its header; ``img_size`` rebuilds it at another size (position embeddings resampled);
- an official ``.npz`` or a timm state dict: the architecture is not in the file, so it needs
  ``model_name`` (``--model ViT-B/16``) and, unless 224, ``img_size`` (``--img-size``). The head's
  class count and a pre-logits layer are read from the file, so the representation is the one
  the file was trained with.

No Ray: the model is built in this process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from vitscale.config.checks import ConfigError

DEFAULT_IMG_SIZE = 224


def _file_head(fmt: str, raw: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(classifier outputs, pre-logits width) stored in an npz, timm or transformers file; None where absent."""
    if fmt == "npz":
        from vitscale.models.flax_layout import official_npz_names

        raw = {k.removeprefix("ResNet/"): v for k, v in official_npz_names(raw).items()}
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
        model_name: the architecture of an npz, timm or transformers file (a vitscale checkpoint names its own;
            given anyway, it must agree).
        img_size: the input size such a file was trained at (default 224; vitscale
            checkpoints know theirs; given anyway, it must agree).
        model_options: options of such a file's architecture (`create_model`'s keyword
            arguments, as a pipeline's `model:` section: depth, width, classifier, ...); vitscale
            checkpoints name their own.
        resolution: the size to probe at (default: the checkpoint's own). A ViT read from a file is
            built at it, its position embeddings resampled from the file's grid; a training
            checkpoint is probed only at its own size (`vitscale export` it first).

    Returns:
        facts: ``checkpoint`` (the file or checkpoint directory read), ``format`` ("run",
        "vitscale", "npz", "timm", "transformers"), ``model`` (name), ``img_size`` (the size the model takes now),
        ``step`` (training step, runs only), ``notes`` (what loading changed: resampling, head).

    Raises:
        FileNotFoundError: no such file or directory, or a directory with no checkpoint.
        ValueError: an unreadable file, an npz, timm or transformers file without ``model_name``, a ``model_name`` or
            ``img_size`` that contradicts a vitscale checkpoint, weights that do not fit the model.
    """
    from vitscale.config.errors import UserError

    try:
        return _load_model(path, model_name=model_name, img_size=img_size, resolution=resolution,
                           model_options=dict(model_options or {}))
    except UserError:
        raise
    except ValueError as exc:
        # Reading a file the user named (models/weights_files.py) or parsing a model name they typed:
        # the error is about that file or name, so it is theirs to fix and shown as one line.
        from vitscale.data.storage.fetch import named_as_stored

        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise UserError(named_as_stored(path, text)) from exc  # a file from s3:// named by its URL, not the cache


def _sized(build: Callable[[], nn.Module], resolution: int | None, img_size: int | None) -> nn.Module:
    """`build()`; a size the model's patches cannot tile is a ConfigError naming the argument that asked for it
    (`create_model` names only its own `img_size`)."""
    flag = "--resolution" if resolution is not None else "--img-size" if img_size is not None else None
    try:
        return build()
    except ConfigError as exc:  # a model option's own error, naming it; the size's is the flag's that set it
        if flag is None or exc.key != "img_size":
            raise
        raise ConfigError(flag, exc.message) from None
    except ValueError as exc:
        if flag is None or "img_size" not in str(exc):
            raise
        raise ConfigError(flag, str(exc)) from None


def _load_model(path: str | Path, *, model_name: str | None, img_size: int | None,
                resolution: int | None, model_options: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    from vitscale.models.factory import create_from_meta, create_model
    from vitscale.models.variants import parse_model_name
    from vitscale.models.weights_files import load_pretrained, read_weights

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
        from vitscale.train.export import model_from_checkpoint, read_newest

        model, _, facts = read_newest(p, model_from_checkpoint)  # a live run's, rotated meanwhile: the next
        checkpoint = facts["checkpoint"]
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
        fmt, raw, meta = read_weights(p)
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
        size = meta.get("img_size") if resolution is None else resolution
        model = _sized(lambda: create_from_meta({**meta, "img_size": size}), resolution, None)
    else:
        if model_name is None:
            article = "an" if fmt == "npz" else "a"
            raise ValueError(f"{p} is {article} {fmt} checkpoint without a vitscale header: name its architecture "
                             "with --model (e.g. --model ViT-B/16) and, unless 224, its input size with --img-size")
        spec = parse_model_name(model_name)
        num_classes, rep = _file_head(fmt, raw)
        del raw
        options: dict[str, Any] = {}
        if rep is not None and spec.family != "resnet":
            options["representation_size"] = rep  # probe the pre-logits the file was trained with
        # 0 is a size to refuse (create_model names it), not "not given"
        size = next((s for s in (resolution, img_size) if s is not None), DEFAULT_IMG_SIZE)
        model = _sized(lambda: create_model(spec.name, num_classes=num_classes or 1, img_size=size,
                                            **{**options, **model_options}), resolution, img_size)
    report = load_pretrained(model, p)
    built: Any = model  # create_model's plain attributes (spec, img_size), which nn.Module's typing hides
    return model, {"checkpoint": str(p), "format": fmt, "model": built.spec.name, "img_size": int(built.img_size),
                   "step": None, "notes": [*report.resampled, *report.notes]}
