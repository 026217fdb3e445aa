"""`vitscale inspect CHECKPOINT --images SHARDS --out DIR`: the paper's model analyses of one checkpoint.

Writes to DIR, each figure with the numbers behind it (Sec. 4.5, App. D.7-D.8):

- ``filter_components.png`` + ``pcs.parquet``: top principal components of the patch-embedding
  filters (Figure 7 left; ViTs only, a hybrid's ResNet stem has no pixel filters);
- ``posemb_similarity.png`` + ``posemb_similarity.parquet``: cosine similarity of each position
  embedding to every other, one tile per patch position (Figure 7 centre);
- ``attention_distance.png`` + ``attention_distance.parquet``: mean attention distance per layer
  and head over the sample images (Figure 7 right);
- ``attention_rollout.png`` + ``rollout.parquet``: attention rollout from the output token to the
  patches of each sample image (Figure 6);
- ``inspect.json``: what was read, what was written, and notes on what was skipped and why.

The checkpoint is read as `vitscale fewshot` reads it (:func:`vitscale.train.weights.load_model`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitscale.data.storage.atomic import atomic_path, write_atomic
from vitscale.data.storage.outputs import check_output, output_folder
from vitscale.inspect.analyses import (
    attention_rollout,
    filter_components,
    position_similarity,
    rollout_map,
    uniform_attention_distance,
)
from vitscale.inspect.extract import (
    attention_stats,
    check_inspectable,
    images_per_pass,
    patch_filters,
    position_table,
    resnet_refusal,
)
from vitscale.inspect.images import sample_images
from vitscale.inspect.plots import (
    plot_attention_distance,
    plot_filter_components,
    plot_position_similarity,
    plot_rollout,
)

COMPONENTS = 28  # Figure 7 (left) shows the top 28 principal components
REPORT = "inspect.json"
"""Written last: its presence says the folder holds one inspect's whole set, and which files are in it."""
FILES = ("pcs.parquet", "filter_components.png", "posemb_similarity.parquet", "posemb_similarity.png",
         "attention_distance.parquet", "attention_distance.png", "rollout.parquet", "attention_rollout.png")
"""Every file an inspect may write besides its report: an earlier inspect's are removed before a new one
writes (a hybrid's set lacks the filter figure; an interrupted one is never read as the earlier's)."""


def _write_parquet(columns: dict[str, Any], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:  # whole or not at all (data/storage/atomic.py)
        pq.write_table(pa.table({k: np.asarray(v) for k, v in columns.items()}), tmp)
    return path


def _grid_index(shape: tuple[int, ...]) -> list[np.ndarray]:
    """Each axis's index of every entry of an array of `shape`, flattened in C order."""
    return [axis.ravel() for axis in np.indices(shape)]


def _filters(model: Any, out: Path, name: str) -> tuple[list[Path], str | None]:
    filters, why = patch_filters(model)
    if filters is None:
        return [], why
    components, explained = filter_components(filters, COMPONENTS)
    k, c, p, _ = components.shape
    comp, chan, y, x = _grid_index(components.shape)
    table = _write_parquet({"component": comp + 1, "explained_variance_ratio": explained[comp], "channel": chan,
                            "y": y, "x": x, "value": components.ravel()}, out / "pcs.parquet")
    title = (f"{name}: top-{k} principal components of the {p}x{p} patch-embedding filters "
             f"({'RGB' if c == 3 else f'mean of {c} channels'}; % of variance)")
    return [table, plot_filter_components(components, explained, out / "filter_components.png", title=title)], None


def _positions(model: Any, out: Path, name: str) -> tuple[list[Path], str | None]:
    table, note = position_table(model)
    if table is None:
        return [], note
    grid = model.cfg.grid
    similarity = position_similarity(table, grid)
    r, c, r2, c2 = _grid_index(similarity.shape)
    parquet = _write_parquet({"row": r + 1, "col": c + 1, "other_row": r2 + 1, "other_col": c2 + 1,
                              "cosine": similarity.ravel()}, out / "posemb_similarity.parquet")
    title = (f"{name}: position embedding similarity\ntile (row, col) = cosine of that patch's "
             f"embedding with every patch's ({grid[0]}x{grid[1]} grid)")
    return [parquet, plot_position_similarity(similarity, out / "posemb_similarity.png", title=title)], note


def _attention(model: Any, images: Any, out: Path, name: str, img_size: int,
               device: torch.device) -> tuple[list[Path], dict[str, Any]]:
    from vitscale.data.loader.transforms import normalize_on_device

    step = images_per_pass(model)
    batches = (normalize_on_device(images.pixels[i:i + step]) for i in range(0, len(images.keys), step))
    stats = attention_stats(model, batches, device)
    n = len(images.keys)
    mean = stats.distance.mean(axis=1)  # (layers, heads): over images
    layer, head = _grid_index(mean.shape)
    paths = [_write_parquet({"layer": layer + 1, "head": head + 1, "distance_px": mean.ravel(),
                             "distance_px_std": stats.distance.std(axis=1).ravel(), "images": np.full(mean.size, n)},
                            out / "attention_distance.parquet")]
    grid, prefix = model.cfg.grid, model.num_prefix_tokens
    uniform = uniform_attention_distance(grid, int(model.patch_embed.stride))
    paths.append(plot_attention_distance(
        mean, out / "attention_distance.png", image_px=img_size, uniform_px=uniform,
        title=f"{name}: mean attention distance of each head by layer\n(attention-weighted pixel distance "
              f"between query and key patches, mean over {n} images)"))

    maps = rollout_map(attention_rollout(stats.head_mean), grid, prefix)  # (B, rows, cols)
    image, row, col = _grid_index(maps.shape)
    paths.append(_write_parquet({"image": image, "key": np.asarray(images.keys)[image], "row": row + 1,
                                 "col": col + 1, "rollout": maps.ravel()}, out / "rollout.parquet"))
    source = "class token" if prefix else "mean of the patch tokens (GAP)"
    paths.append(plot_rollout(
        images.pixels.permute(0, 2, 3, 1).numpy(), maps, images.captions, out / "attention_rollout.png",
        title=f"{name}: attention rollout from the output ({source}) to the input patches\n"
              "(Abnar & Zuidema 2020: heads averaged, + identity, rows renormalised, layers multiplied)"))
    return paths, {"layers": int(mean.shape[0]), "heads": int(mean.shape[1]),
                   "uniform_distance_px": round(uniform, 3),
                   "distance_px_by_layer": [round(float(v), 3) for v in mean.mean(axis=1)]}


def inspect_checkpoint(path: str | Path, images: str, out: str | Path, *, count: int = 8, split: str = "train",
                       model_name: str | None = None, img_size: int | None = None,
                       endpoint_url: str | None = None, device: torch.device | None = None,
                       progress: bool = False, model_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write every analysis of the checkpoint at `path` on `count` images of `images` into `out`.

    `progress` shows the steps (read, images, filters, positions, attention) on stderr as they finish.

    `model_name` / `img_size` name the architecture of an npz / timm file (as `vitscale fewshot`).
    Returns what ``inspect.json`` holds: the checkpoint's facts, the images' keys, the files
    written, and notes (what loading changed, analyses that do not apply and why).

    Raises:
        FileNotFoundError / ValueError (ConfigError): a missing checkpoint or dataset, a bad count or
        split, a ResNet (inspect analyses ViTs and hybrids).
    """
    from vitscale.data.tools.progress import Progress
    from vitscale.models.variants import parse_model_name
    from vitscale.train.weights import load_model

    target = check_output(str(out), "--out", folder=True, endpoint_url=endpoint_url)  # before minutes of work
    bar = Progress(5, f"inspect {path}", unit="step", enabled=progress)
    if model_name is not None and parse_model_name(model_name).family == "resnet":
        raise resnet_refusal(parse_model_name(model_name).name)  # before a large file is read
    model, facts = load_model(path, model_name=model_name, img_size=img_size, model_options=model_options)
    vit = check_inspectable(model)
    bar.update()
    name, size = f"{facts['model']} ({facts['img_size']} px)", int(facts["img_size"])
    sample = sample_images(images, split, count, size, endpoint_url=endpoint_url)
    bar.update()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    notes = list(facts["notes"])
    files: list[Path] = []
    with output_folder(target, "--out", endpoint_url=endpoint_url, marker=REPORT, replaces=FILES) as folder:
        for paths, note in (_filters(vit, folder, name), _positions(vit, folder, name)):
            files += paths
            notes += [note] if note else []
            bar.update()
        paths, attention = _attention(vit, sample, folder, name, size, device)
        bar.update()
        files += paths
        report = {**facts, "images": images, "split": split, "image_keys": sample.keys, **attention,
                  "files": sorted(p.name for p in files), "notes": notes}
        write_atomic(folder / REPORT, json.dumps(report, indent=2, default=str) + "\n")
    bar.close()
    return report
