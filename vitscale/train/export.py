"""From a run's checkpoint to one fp32 model: `vitscale export`, and the fewshot stage's model.

A training checkpoint is DeepSpeed's sharded state plus vitscale's resolved config. Consolidation
gathers the ZeRO shards into one fp32 state dict (offline, no process group), rebuilds the model
the config names, and loads the weights strictly, so an export is exactly what was trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

from vitscale.config.errors import UserError
from vitscale.config.loader import build_section
from vitscale.config.location import FINETUNE_PART, SIBLING_FINETUNE_SUFFIX, is_url
from vitscale.data.storage.fetch import is_folder, local_copy, subfolders
from vitscale.data.storage.outputs import check_output, output_file
from vitscale.models.config import ModelConfig
from vitscale.train import checkpoint as ckpt
from vitscale.train.job import trained_sections


def _weights_files_in(folder: Path) -> str:
    """For a folder that is no run (a model downloaded from a hub: its `model.safetensors` or `pytorch_model.bin`):
    the weights files in it, to name instead (`; it holds ...`), or ''."""
    from vitscale.models.weights_files import WEIGHTS_SUFFIXES

    found = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHTS_SUFFIXES)
    if not found:
        return ""
    return (f"; it holds weights: name the file ({folder / found[0]}"
            f"{f' or {len(found) - 1} more' if len(found) > 1 else ''}) and its architecture (--model, or a "
            "pipeline's model: section)")


def find_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest complete `checkpoint_*` inside it.

    `path` may be in object storage (`s3://.../run` or `.../run/checkpoint_*`): the checkpoint found
    there is copied into the local cache (`data/storage/fetch.py`), newest first, until a complete one.
    """
    if is_url(str(path)) and not str(path).startswith("file://"):
        return _find_remote_checkpoint(str(path))
    path = local_copy(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run or checkpoint directory")
    info = ckpt.manifest_info(path)
    if info is None and any(path.glob("MANIFEST-rank*.json")):
        raise UserError(f"{path} is an incomplete checkpoint: no readable manifest")
    if info is not None:
        problems = ckpt.check_complete(path, info[1])
        if problems:
            raise UserError(f"{path} is an incomplete checkpoint: " + "; ".join(problems))
        return path
    candidates = [p for p in path.glob("checkpoint_*") if p.is_dir()]
    if not candidates:
        trained = _trained_elsewhere(path)
        if trained is not None:
            return find_checkpoint(trained)
        raise FileNotFoundError(f"{path}: no checkpoint_* directories (is it a vitscale run directory?)"
                                f"{_weights_files_in(path)}")
    found = ckpt.latest_complete(candidates)
    if found is None:
        raise UserError(f"{path}: none of its {len(candidates)} checkpoints is complete")
    return found


T = TypeVar("T")


def read_newest(path: str | Path, read: Callable[[Path], T]) -> T:
    """`read` of `path`'s newest complete checkpoint (`find_checkpoint`), even while a live run rotates it away.

    A run that trains keeps its newest `train.keep_checkpoints` and deletes older ones once a newer one is
    complete, so the checkpoint chosen here can vanish while `read` reads it (`vitscale export`, `fewshot`,
    `inspect` or a fine-tune of a run that still trains: `[Errno 2] No such file ... checkpoint_000000012/...`).
    Then the newest complete checkpoint is found again and read; an error reading a checkpoint that is still
    the newest is that checkpoint's own, raised as it is.
    """
    checkpoint, tried = find_checkpoint(path), set()
    while True:
        try:
            return read(checkpoint)
        except (OSError, ValueError, RuntimeError):
            tried.add(checkpoint)
            try:
                newer = find_checkpoint(path)
            except (OSError, ValueError):
                newer = checkpoint
            if newer in tried:
                raise
            checkpoint = newer  # a newer one replaced it meanwhile


def local_weights(location: str | Path) -> Path:
    """A local path for weights at `location`: a file (export, .npz, timm) or a training checkpoint.

    Local paths are returned as they are; in object storage a file is copied into the cache, and a
    run or checkpoint folder gives its newest complete checkpoint, copied (`find_checkpoint`).
    """
    if is_url(str(location)) and is_folder(location):
        return find_checkpoint(location)
    return local_copy(location)


def _trained_elsewhere(run_dir: Path) -> str | None:
    """The training run a pipeline's run directory points to, when it has no checkpoints of its own.

    `vitscale finetune` (and a pipeline whose last training stage is `finetune`) trains in a Ray Train run
    of its own, `<run>/finetune` (config/location.py), while the console prints the pipeline's run
    directory: that directory's summary.json names the checkpoint (the fine-tuned one first); a run that
    died before writing it has its fine-tuning run inside it, or, in the older layout, beside it
    (`<run>-finetune`).
    """
    import json

    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            stages = json.loads(summary.read_text())
        except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: as if there were none
            stages = {}
        stages = stages if isinstance(stages, dict) else {}
        for stage in ("finetune", "pretrain"):
            entry = stages.get(stage)
            if isinstance(entry, dict) and isinstance(entry.get("checkpoint"), str):
                return str(entry["checkpoint"])
    for trained in (run_dir / FINETUNE_PART, run_dir.parent / f"{run_dir.name}{SIBLING_FINETUNE_SUFFIX}"):
        if trained.is_dir():
            return str(trained)
    return None


def _find_remote_checkpoint(url: str) -> Path:
    folders = _checkpoint_folders(url)
    if not folders:
        # A pipeline run whose training was its fine-tuning keeps it inside (or, in the older layout, beside
        # it): only that part is copied, not the whole run.
        trained = _trained_part(url)
        if trained is not None:
            return _find_remote_checkpoint(trained)
        refused = _not_a_checkpoint(url)
        if refused is not None:
            # Copied whole, a dataset's prefix or a storage path of many runs would be downloaded (terabytes), a
            # model file too, only to find no checkpoint in the copy; and the error named the cache, not the URL.
            raise FileNotFoundError(f"{url}: {refused}")
        return find_checkpoint(local_copy(url))  # the URL is a checkpoint itself
    problems = []
    for folder in reversed(folders):  # checkpoint_{step:09d}: the name orders by step
        local = local_copy(folder)
        info = ckpt.manifest_info(local)
        found = ["no readable manifest"] if info is None else ckpt.check_complete(local, info[1])
        if not found:
            return local
        problems.append(f"{folder}: {'; '.join(found)}")
    raise UserError(f"{url}: none of its {len(folders)} checkpoints is complete ({problems[0]})")


def _not_a_checkpoint(url: str) -> str | None:
    """Why the object or folder at `url` (which has no checkpoint_* folders) cannot be a checkpoint, nor a run
    whose summary.json names one; None when it may (or when nothing is there: `local_copy` says so). One
    listing, nothing downloaded."""
    from vitscale.data.storage import open_storage

    parent, _, name = url.rstrip("/").rpartition("/")
    if parent.endswith(":/"):  # the bucket itself: its top-level names
        tops = {key.split("/", 1)[0] for key in open_storage(url).list()}
    else:
        keys = open_storage(parent).list(name)  # `name` itself (a file), `name/...`, and siblings `name2...`
        if name in keys:
            return "one file, not a run or checkpoint folder (a model file is read by fewshot and inspect)"
        tops = {key[len(name) + 1:].split("/", 1)[0] for key in keys if key.startswith(name + "/")}
        if not tops:
            return None
    if "summary.json" in tops or any(top.startswith("MANIFEST-rank") for top in tops):
        return None
    return "no checkpoint_* folders, and no checkpoint itself (no MANIFEST-rank*.json): is it a vitscale run directory?"


def _checkpoint_folders(url: str) -> list[str]:
    return [f for f in subfolders(url) if f.rsplit("/", 1)[-1].startswith("checkpoint_")]


def _trained_part(url: str) -> str | None:
    """The fine-tuning run of the pipeline run at `url` in object storage, if it has checkpoints."""
    run = url.rstrip("/")
    # The older layout's sibling of a run at a bucket's root would be another bucket (`s3://b-finetune`): none.
    siblings = [] if run.rpartition("/")[0].endswith(":/") else [f"{run}{SIBLING_FINETUNE_SUFFIX}"]
    for trained in (f"{run}/{FINETUNE_PART}", *siblings):
        if _checkpoint_folders(trained):
            return trained
    return None


def model_from_checkpoint(checkpoint: str | Path) -> tuple[torch.nn.Module, ModelConfig, dict[str, Any]]:
    """(model with the trained fp32 weights, the run's model config, facts) from a training checkpoint.

    Reads only what the weights are (`trained:`, else the `model` section and `train.objective`:
    `train/job.py` `trained_sections`) and `train.seed` of the checkpoint's resolved config: the
    weights fix everything else.
    """
    from vitscale.train.engine import consolidated_state_dict

    checkpoint = Path(checkpoint)
    config_path = checkpoint / "config.yaml"
    raw = yaml.safe_load(config_path.read_text()) or {}
    model_raw, objective = trained_sections(raw)  # a fine-tuning checkpoint's own architecture, not the pipeline's
    model_config = build_section(ModelConfig, model_raw, "model")
    state = consolidated_state_dict(checkpoint / ckpt.DEEPSPEED_DIR, ckpt.DEEPSPEED_TAG)
    if objective == "masked_patch":
        model, model_config = _masked_patch_encoder(state, model_config)
    else:
        num_classes = int(state["head.weight"].shape[0])
        model = model_config.build(num_classes)
        model.load_state_dict(state, strict=True)
    facts = {"model": model_config.name, "num_classes": int(getattr(model, "num_classes", 0)),
             "img_size": model_config.img_size, "step": ckpt.read_train_state(checkpoint).step,
             "checkpoint": str(checkpoint), "seed": int((raw.get("train") or {}).get("seed", 0)),
             "objective": objective}
    return model, model_config, facts


def _masked_patch_encoder(state: dict[str, Any], model_config: ModelConfig) -> tuple[torch.nn.Module, ModelConfig]:
    """A masked patch run's encoder (a ViT without a classifier): its prediction head and [mask] dropped.

    Transfer from it is transfer from any pre-trained ViT: a fine-tuning head is zero-initialised (Sec. 3.2)."""
    from vitscale.train.objective import encoder_config

    model_config = encoder_config(model_config)
    model = model_config.build(0)
    prefix = "encoder."
    encoder = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    dropped = sorted(k for k in state if not k.startswith(prefix))
    if dropped != ["head.bias", "head.weight", "mask_token"]:
        raise UserError(f"a masked patch checkpoint holds encoder.*, mask_token and head.*; this one also "
                        f"{[k for k in dropped if k not in ('head.bias', 'head.weight', 'mask_token')]}")
    # The encoder's 0-class head holds no values: the checkpoint has none (the predictor replaced it).
    missing, unexpected = model.load_state_dict(encoder, strict=False)
    if unexpected or any(k not in ("head.weight", "head.bias") for k in missing):
        raise UserError(f"the masked patch checkpoint's encoder does not match model {model_config.name}: "
                        f"missing {missing}, unexpected {unexpected}")
    return model, model_config


def export_format(out: str | Path, fmt: str | None) -> str:
    """The file format of an export to `out`: `fmt`, else the one its suffix names (.npz: big_vision's
    layout; anything else: a vitscale state dict). A suffix that names the other format is refused: a
    `.npz` holding a torch file (or the reverse) would fail in whatever reads it next."""
    suffix = Path(out).suffix.lower()
    named = "npz" if suffix == ".npz" else "pt" if suffix in (".pt", ".pth") else None
    if fmt is None:
        return named or "pt"
    if fmt not in ("pt", "npz"):
        raise UserError(f"--format: must be pt or npz, got {fmt!r}")
    if named is not None and named != fmt:
        raise UserError(f"--out {out}: its suffix {suffix} names the {named} format, but --format is {fmt}: "
                        f"name the file .{fmt}, or drop --format")
    return fmt


@contextmanager
def _full_disk_named(target: str, need: int) -> Iterator[None]:
    """A disk without room for the model's `need` bytes at `target`: one line naming it and the space, before
    the write when it is already too full, else instead of the writer's own error (torch's C++ writer says
    "unexpected pos 704 vs 598", no errno); the part file written is removed (`atomic_path`)."""
    from vitscale.data.storage.base import StorageError
    from vitscale.data.storage.space import free_bytes, free_text, is_no_space, size_text

    def full() -> StorageError:
        return StorageError(f"no space left on the device of {target} for the model ({free_text(target, free)}, "
                            f"it needs about {size_text(need)}); free space there or choose another --out, and "
                            "export again")

    free = free_bytes(target)  # None for a URL (written to a local spool first): its store says
    if free is not None and free < need:
        raise full()
    try:
        yield
    except (OSError, RuntimeError) as exc:
        free = free_bytes(target)  # after the part file's removal: what the disk had for it
        if not isinstance(exc, StorageError) and (
                is_no_space(exc) or (isinstance(exc, RuntimeError) and free is not None and free < need)):
            raise full() from exc
        raise


def export_run(run_dir: str | Path, out: str | Path, *, fmt: str | None = None,
               progress: bool = False) -> dict[str, Any]:
    """Write the run's latest complete checkpoint as one fp32 file that `load_pretrained` reads, in `fmt`
    (`export_format`: by default the one `out`'s suffix names).

    `progress` shows the two steps (consolidating the ZeRO shards, writing the file) on stderr.
    """
    from vitscale.data.tools.progress import Progress
    from vitscale.models.factory import model_meta
    from vitscale.models.weights_files import export_npz, export_state_dict

    fmt = export_format(out, fmt)
    target = check_output(str(out), "--out", folder=False)  # before the shards are read and consolidated
    bar = Progress(2, f"export {run_dir}", unit="step", enabled=progress)
    model, _, facts = read_newest(run_dir, model_from_checkpoint)
    bar.update()
    need = sum(t.numel() * 4 for t in model.state_dict().values())  # fp32: the format's own bytes are few
    with _full_disk_named(target, need), output_file(target, "--out") as path:
        if fmt == "npz":
            export_npz(model, path)
        else:
            # `create_from_weights` rebuilds from it; `path` is a temporary name: the destination's suffix decides.
            export_state_dict(model, path, meta=model_meta(model), safetensors=target.endswith(".safetensors"))
    bar.update()
    bar.close()
    return {**facts, "out": target, "format": fmt}
