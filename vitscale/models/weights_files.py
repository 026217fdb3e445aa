"""Load and export weights: official Flax .npz, timm state dicts, vitscale's own export.

Formats read by `load_pretrained` (chosen by file suffix / content):

- ``.npz`` (names and layouts: `models/flax_layout.py`): google-research/vision_transformer layout
  (``Transformer/encoderblock_0/...``, ``embedding/kernel``, ``cls``, hybrid ResNet keys ``conv_root``,
  ``block1/unit1/...``, with or without a ``ResNet/`` prefix) for ViT and hybrids; BiT layout
  (``resnet/root_block/...``) for standalone ResNets; training checkpoints too: the repo's ``opt/target/`` and
  big_vision's ``params/`` layout (its own block numbering, a scanned encoder, positions for the patches alone).
  Entries named ``vitscale/<param>`` carry parameters that have no official counterpart (2-D / per-layer / relative
  position tables) in PyTorch layout. bfloat16 entries (JAX writes them as 2-byte voids) are widened to float32; an
  entry of no float type is refused.
- ``.pth`` / ``.pt`` / ``.bin`` (``torch.load(weights_only=True)``) and ``.safetensors``: a timm
  state dict (optionally wrapped in ``state_dict`` / ``model`` / ``module``; ``module.``
  prefixes stripped; a training script's checkpoint with its ``args`` too), a Hugging Face transformers
  ViT's (``pytorch_model.bin``, ``model.safetensors``: renamed to timm's, `models/transformers_layout.py`)
  or a vitscale export (a header ``{"format": "vitscale", "meta": ...}``).

Position embeddings are resampled when the grid differs (a timm ``no_embed_class`` table, one row per
patch, gets a zero class-token row: what timm computes); a head whose class count differs
(or a pre-logits layer the model does not have) is left as the model's zero-init one.

Known inexactness with official Flax weights (all round trips within vitscale are exact):
GELU is exact here (timm) but tanh-approximated in Flax; for GAP models the official code
applies ``encoder_norm`` before pooling while vitscale/timm apply ``fc_norm`` after it, and
``Transformer/encoder_norm`` maps onto ``fc_norm``; weight standardisation uses
``sqrt(var + 1e-8)`` where the Flax hybrid uses ``std + 1e-5``.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vitscale.models.factory import create_from_meta, model_meta
from vitscale.models.flax_layout import npz_arrays, npz_to_state_dict
from vitscale.models.posemb import resample_1d, resample_posemb, resample_relative_table
from vitscale.models.resnet import ResNetV2
from vitscale.models.transformers_layout import LAYER_NORM_NOTE, from_transformers, is_transformers_vit
from vitscale.models.variants import parse_model_name
from vitscale.models.vit import VisionTransformer

__all__ = ["WEIGHTS_SUFFIXES", "LoadReport", "create_from_weights", "export_npz", "export_state_dict",
           "load_pretrained", "read_weights", "timm_state_dict"]

WEIGHTS_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".npz")
"""The names of the weights files `read_weights` reads (the module doc), by their suffix."""
_TRAINING_SCRIPT_GLOBALS: list[Any] = [argparse.Namespace]
"""Classes besides tensors and plain data a weights file may hold: timm's train.py, DeiT's and MAE's main.py save
their command line (an argparse.Namespace, plain values) beside the weights in every checkpoint they write."""
_HEAD_PREFIXES = ("head.", "pre_logits.")
_MAX_LISTED = 25


@dataclass(frozen=True)
class LoadReport:
    """What `load_pretrained` did."""

    path: str
    source_format: str
    """"npz", "timm", "transformers" or "vitscale"."""
    loaded: tuple[str, ...]
    """Model parameters filled from the file."""
    resampled: tuple[str, ...] = ()
    """Position tables interpolated to the model's grid, e.g. "pos_embed: 14x14 -> 24x24"."""
    kept: tuple[str, ...] = ()
    """Model parameters left as initialised (head / pre-logits: fine-tuning case)."""
    dropped: tuple[str, ...] = ()
    """File entries deliberately not used (a head for another class count, unused pre-logits)."""
    notes: tuple[str, ...] = ()
    meta: Mapping[str, Any] | None = field(default=None, compare=False)
    """vitscale export header, when the file had one."""

    @property
    def head_kept(self) -> bool:
        """True when the classifier was not loaded (new class count): fine-tune from here."""
        return any(name.startswith("head.") for name in self.kept)

    def __str__(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors from {self.path} ({self.source_format})"]
        lines += [f"  resampled {r}" for r in self.resampled]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _unwrap(obj: Any) -> dict[str, Tensor]:
    """A flat name -> tensor dict from common wrappers (state_dict / model / module)."""
    for _ in range(3):
        if isinstance(obj, Mapping) and not any(isinstance(v, Tensor) for v in obj.values()):
            inner = [obj[k] for k in ("state_dict", "model", "module", "model_state_dict") if k in obj]
            if len(inner) == 1:
                obj = inner[0]
                continue
        break
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError("file is not a state dict (a mapping of parameter names to tensors)")
    out = {}
    for k, v in obj.items():
        for prefix in ("module.", "_orig_mod."):
            k = k.removeprefix(prefix)
        out[str(k)] = v
    return out


def read_weights(path: str | Path) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """Read a checkpoint file: (format, raw entries, vitscale meta or None).

    format is "npz" (entries are numpy arrays under Flax names), "timm", "transformers" (renamed to timm's
    names: `models/transformers_layout.py`) or "vitscale" (entries are tensors under PyTorch names). ValueError
    if unreadable.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"checkpoint {p} does not exist or is not a file")
    try:
        if p.suffix == ".npz":
            if not zipfile.is_zipfile(p):  # numpy would take it for a pickle and suggest allow_pickle=True
                raise ValueError("not an .npz archive (a zip of arrays); cut short, or another kind of file")
            with np.load(p, allow_pickle=False) as f:
                return "npz", {k: f[k] for k in f.files}, None
        if p.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            with safe_open(str(p), framework="pt") as f:
                header = f.metadata() or {}
            sd = load_file(str(p))
            if header.get("format") == "vitscale":
                try:
                    meta = json.loads(header.get("meta", "{}"))
                except ValueError as exc:
                    raise ValueError(f"its vitscale header is not JSON ({exc})") from exc
                return "vitscale", dict(sd), _vitscale_header(meta)
            return _torch_layout(_unwrap(sd))
        with torch.serialization.safe_globals(_TRAINING_SCRIPT_GLOBALS), warnings.catch_warnings():
            # torch's note on a pickle protocol it did not write comes before its refusal: the refusal is the line.
            # catch_warnings is process-wide, not per thread: fine here, where one thread per process reads weights
            # (the driver's checks, each worker's start); threaded callers would need pil_quiet's counted filter.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            obj = torch.load(p, map_location="cpu", weights_only=True)
        if isinstance(obj, Mapping) and obj.get("format") == "vitscale":
            return "vitscale", _unwrap(obj.get("state_dict")), _vitscale_header(obj.get("meta"))
        return _torch_layout(_unwrap(obj))
    except ValueError as exc:  # numpy's refusal of pickled arrays, a damaged header: named with the file
        raise ValueError(f"cannot read checkpoint {p}: {exc}") from exc
    except Exception as exc:  # pickle/zip/safetensors errors: one user-facing error type
        raise ValueError(f"cannot read checkpoint {p}: {_why_unreadable(exc, _zip_magic(p))}") from exc


def _torch_layout(sd: dict[str, Tensor]) -> tuple[str, dict[str, Any], None]:
    """A state dict without a vitscale header: timm's names, or transformers' renamed to them."""
    if is_transformers_vit(sd):
        return "transformers", from_transformers(sd), None
    return "timm", sd, None


def _vitscale_header(meta: Any) -> dict[str, Any]:
    """A vitscale export's header as `export_state_dict` writes it; anything else a ValueError (a list where
    the mapping goes was a TypeError, a header without `name` a KeyError, in whoever read it next)."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"its vitscale header is a {type(meta).__name__}, not a mapping")
    kinds = {"name": str, "num_classes": int, "img_size": int}
    wrong = [k for k, kind in kinds.items() if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool)]
    if wrong or not isinstance(meta.get("overrides") or {}, Mapping):
        raise ValueError(f"its vitscale header needs name (text), num_classes and img_size (integers) and "
                         f"overrides (a mapping, if any); got {dict(meta)}")
    try:
        parse_model_name(meta["name"])
    except ValueError as exc:
        raise ValueError(f"its vitscale header names no model vitscale builds: {exc}") from exc
    return dict(meta)


def _zip_magic(path: Path) -> bool:
    """The file begins as a zip archive does (torch's format since 1.6): whole or not, it was meant to be one."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _why_unreadable(exc: Exception, zipped: bool = False) -> str:
    """A reader's error as one line. torch's refusal of a pickle that is not plain tensors is paragraphs
    (with terminal colour codes) advising to load it with `weights_only=False`, which would run whatever
    code the file holds: kept to its reason, with what vitscale reads instead."""
    import pickle
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if isinstance(exc, EOFError):  # the unpickler ran out of bytes before the first object: "EOFError: " alone
        return "an empty or cut-short file (it ends before its first object)"
    if isinstance(exc, (OSError, RuntimeError)) and zipped:  # torch's zip reader: "[Errno 22] Invalid argument"
        return f"a damaged or cut-short torch file (a zip archive torch cannot read: {' '.join(text.split())})"
    if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in text:
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\s*Check the documentation|$)", text, re.S)
        reason = " ".join(found.group(1).split()) if found else "not a torch file"
        return (f"not a file of tensors that loads without running code ({reason}); vitscale reads weights "
                f"only: save the model's state_dict (torch.save(model.state_dict(), path)), or `vitscale export` a run")
    return f"{type(exc).__name__}: {' '.join(text.split())}"


def _from_timm(sd: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """timm -> vitscale names: identical except the ResNetV2 head (timm: 1x1 conv `head.fc`)."""
    out = dict(sd)
    if isinstance(model, ResNetV2):
        for suffix in ("weight", "bias"):
            v = out.pop(f"head.fc.{suffix}", None)
            if v is not None:
                out[f"head.{suffix}"] = v.reshape(v.shape[0], -1) if suffix == "weight" else v
    return out


# ----------------------------------------------------------------------------------------------
# Reconciling a state dict with the model.


def _grid_of(n: int, meta: Mapping[str, Any] | None, model: nn.Module) -> tuple[int, int]:
    stride = getattr(getattr(model, "spec", None), "stride", None)
    if meta and "img_size" in meta and stride:
        side = int(meta["img_size"]) // stride
        if side * side == n:
            return side, side
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"cannot infer the source grid of {n} position embeddings (not square)")
    return side, side


def _resample(name: str, src: Tensor, dst: Tensor, model: nn.Module, file_prefix: int,
              meta: Mapping[str, Any] | None) -> tuple[Tensor, str] | None:
    """Resampled `src` shaped like `dst`, with a description; None if not a resampleable pair."""
    if not isinstance(model, VisionTransformer) or src.dim() != dst.dim():
        return None
    if name == "pos_embed" and src.dim() == 3 and src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2]:
        prefix = model.num_prefix_tokens
        if file_prefix != prefix:
            return None
        old = _grid_of(src.shape[1] - prefix, meta, model)
        out = resample_posemb(src, model.cfg.grid, prefix, old_grid=old)
        return out, f"pos_embed: {old[0]}x{old[1]} -> {model.cfg.grid[0]}x{model.cfg.grid[1]}"
    if name in ("pos_embed_row", "pos_embed_col") and src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2]:
        return resample_1d(src, dst.shape[1]), f"{name}: {src.shape[1]} -> {dst.shape[1]}"
    if name.endswith("attn.rel_bias") and src.shape[0] == dst.shape[0]:
        new_len = (dst.shape[1] + 1) // 2
        return resample_relative_table(src, new_len), f"{name}: {src.shape[1]} -> {dst.shape[1]} offsets"
    return None


def _class_row_added(src: Tensor, model: nn.Module, notes: list[str]) -> Tensor:
    """A timm ``no_embed_class`` table (one row per patch, a square count: the class token gets no position)
    with a zero row for the class token: adding it to [class; patches] is what timm computes. Once refused as
    "cannot infer the source grid of 195 position embeddings (not square)"."""
    n = src.shape[1] if src.dim() == 3 else 0
    if getattr(model, "num_prefix_tokens", None) != 1 or n < 2 or math.isqrt(n) ** 2 != n:
        return src
    notes.append("pos_embed has no class-token row (timm's no_embed_class): the class token gets a zero one")
    return torch.cat([src.new_zeros(src.shape[0], 1, src.shape[2]), src], dim=1)


def _listing(title: str, items: list[str]) -> str:
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{title} ({len(items)}): {', '.join(items[:_MAX_LISTED])}{more}"


def _refuse_misfit(path: str | Path, fmt: str, model: nn.Module, **lists: list[str]) -> None:
    """A ValueError listing each of `lists` (missing, unexpected, shape mismatch) that is not empty, if any is."""
    if not any(lists.values()):
        return
    parts = [f"checkpoint {path} ({fmt}) does not fit {type(model).__name__}"
             f" {getattr(getattr(model, 'spec', None), 'name', '')}".rstrip()]
    for title, items in lists.items():
        if items:
            parts.append(_listing("shape mismatch" if title == "mismatched" else title, items))
    raise ValueError("\n  ".join(parts))


def _head_notes(model: nn.Module, kept: list[str], dropped: list[str], meta: dict[str, Any] | None) -> list[str]:
    """The report's notes on the head and pre-logits left out, and on a file exported from another model."""
    notes = []
    if any(k.startswith("head.") for k in kept):
        notes.append(f"classifier not loaded (file: {sorted(d for d in dropped if d.startswith('head.')) or 'none'});"
                     f" kept the model's zero-init head with {getattr(model, 'num_classes', '?')} classes")
    if any(d.startswith("pre_logits.") for d in dropped):
        notes.append("pre-logits layer in the file dropped: the model has none (fine-tuning recipe)")
    spec: Any = getattr(model, "spec", None)
    if meta and spec is not None and meta.get("name") != spec.name:
        notes.append(f"file was exported from {meta.get('name')!r}, model is {spec.name!r}")
    return notes


def load_pretrained(model: nn.Module, path: str | Path) -> LoadReport:
    """Load official .npz, timm or vitscale weights into `model` in place.

    Position embeddings are resampled to the model's grid; a head of another class count,
    or pre-logits the model lacks, are not loaded (the model keeps its zero-init head) and
    the report says so. Raises ValueError listing missing / unexpected / shape-mismatched
    parameters when the file does not fit the model.
    """
    fmt, raw, meta = read_weights(path)
    if fmt == "npz":
        try:
            sd, unexpected = npz_to_state_dict(raw, model)
        except ValueError as exc:  # entries that do not convert (other dims, other heads): name the file
            raise ValueError(f"checkpoint {path} (npz) does not fit {type(model).__name__}: {exc}") from exc
    else:
        sd, unexpected = _from_timm(raw, model), []
    target = model.state_dict(keep_vars=True)
    file_prefix = 1 if "cls_token" in sd else 0
    loaded: list[str] = []
    resampled: list[str] = []
    kept: list[str] = []
    dropped: list[str] = []
    notes: list[str] = []
    mismatched: list[str] = []
    present: set[str] = set()
    values: dict[str, Tensor] = {}
    for name, src in sd.items():
        if name not in target:
            if name.startswith(_HEAD_PREFIXES):
                dropped.append(name)
            else:
                unexpected.append(name)
            continue
        dst = target[name]
        if name == "pos_embed" and tuple(src.shape) != tuple(dst.shape) and file_prefix:
            src = _class_row_added(src, model, notes)
        if tuple(src.shape) != tuple(dst.shape):
            if name.startswith(_HEAD_PREFIXES):
                dropped.append(name)
                continue
            try:
                res = _resample(name, src, dst, model, file_prefix, meta)
            except ValueError as exc:  # a table that cannot be resampled (say, not a square grid): name the file
                raise ValueError(f"checkpoint {path}: {name} {tuple(src.shape)} does not fit the model's "
                                 f"{tuple(dst.shape)}: {exc}") from exc
            if res is None:
                mismatched.append(f"{name} file {tuple(src.shape)} vs model {tuple(dst.shape)}")
                present.add(name)  # in the file, at the wrong shape: not also "missing"
                continue
            src, what = res
            resampled.append(what)
        values[name] = src
    missing: list[str] = []
    for name in target:
        if name in values or name in present:
            continue
        (kept if name.startswith(_HEAD_PREFIXES) else missing).append(name)
    _refuse_misfit(path, fmt, model, missing=missing, unexpected=unexpected, mismatched=mismatched)
    # Head and pre-logits go together: a head trained on other pre-logits features is useless.
    if any(k.startswith("pre_logits.") for k in kept + dropped):
        for name in [n for n in values if n.startswith("head.")]:
            values.pop(name)
            kept.append(name)
            dropped.append(name)
    with torch.no_grad():
        for name, src in values.items():
            target[name].copy_(src.to(dtype=target[name].dtype, device=target[name].device))
            loaded.append(name)
    notes.extend(_head_notes(model, kept, dropped, meta))
    if fmt == "transformers":
        notes.append(LAYER_NORM_NOTE)
    return LoadReport(str(path), fmt, tuple(loaded), tuple(resampled), tuple(sorted(set(kept))),
                      tuple(sorted(set(dropped))), tuple(notes), meta)


# ----------------------------------------------------------------------------------------------
# Export.


def _numpy(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()  # numpy has no bfloat16; the official files are float32
    return t.numpy()


def export_npz(model: nn.Module, path: str | Path) -> None:
    """Write `model` in the official Flax layout (BiT layout for standalone ResNets).

    Parameters with no official counterpart are stored as ``vitscale/<name>`` in PyTorch layout.
    Half-precision weights are written as float32.
    """
    arrays = npz_arrays(model, {k: _numpy(v) for k, v in model.state_dict().items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # an open file keeps numpy from appending ".npz" to the name
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub reads **arrays as allow_pickle


def timm_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights under timm's names (ViT / hybrid: identical; ResNetV2: head -> head.fc 1x1 conv).

    Tensors share storage with the model (no copy: ViT-L/H dicts are large); clone to keep a snapshot.
    """
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if isinstance(model, ResNetV2) and "head.weight" in sd:
        w = sd.pop("head.weight")
        sd["head.fc.weight"] = w.reshape(*w.shape, 1, 1)
        sd["head.fc.bias"] = sd.pop("head.bias")
    return sd


def export_state_dict(model: nn.Module, path: str | Path, meta: Mapping[str, Any] | None = None, *,
                      safetensors: bool | None = None) -> None:
    """Write a vitscale export: state dict + header (name, num_classes, img_size, overrides).

    ``.safetensors`` paths get the header as JSON metadata; anything else is a `torch.save`
    of ``{"format": "vitscale", "version": 1, "meta": ..., "state_dict": ...}`` that loads with
    ``weights_only=True``. meta=None uses `model_meta(model)`. `safetensors` decides instead of the
    suffix where `path` is a temporary name of the file (`data/storage/outputs.py`).
    """
    header = dict(meta) if meta is not None else model_meta(model)
    for key in ("name", "num_classes", "img_size"):
        if key not in header:
            raise ValueError(f"export meta needs {key!r}; got keys {sorted(header)}")
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".safetensors" if safetensors is None else safetensors:
        from safetensors.torch import save_file

        save_file(sd, str(p), metadata={"format": "vitscale", "meta": json.dumps(header)})
    else:
        torch.save({"format": "vitscale", "version": 1, "meta": header, "state_dict": sd}, p)


def create_from_weights(path: str | Path) -> tuple[nn.Module, LoadReport]:
    """Rebuild a model from a vitscale export's header and load its weights."""
    fmt, _, meta = read_weights(path)
    if fmt != "vitscale" or not meta:
        raise ValueError(f"{path} is a {fmt} checkpoint without a vitscale header; use create_model + load_pretrained")
    model = create_from_meta(meta)
    return model, load_pretrained(model, path)

