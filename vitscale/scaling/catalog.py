"""The model catalog: parameters and analytic compute of every named model.

Backs the CLI verbs ``vitscale models [--json]`` (`model_rows`, `models_markdown`) and
``vitscale flops MODEL ...`` (`flops_summary`, `summary_markdown`). Parameters are counted on
models built on the meta device (no memory, no init cost: all of the zoo in ~2 s); FLOPs come
from `vitscale.scaling.flops` (the paper's convention, see that module).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vitscale.config.checks import check, positive_int
from vitscale.models.factory import create_model, model_names, parse_model_name
from vitscale.scaling.flops import (
    JFT300M_EXAMPLES,
    TRAIN_FLOPS_MULTIPLIER,
    exaflops,
    flops_breakdown,
    forward_flops,
    masked_patch_flops,
    training_flops,
)


def count_params(name: str, *, num_classes: int = 1000, img_size: int = 224, **overrides: Any) -> int:
    """Parameters of `create_model(name, ...)`, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = create_model(name, num_classes=num_classes, img_size=img_size, **overrides)
    return sum(p.numel() for p in model.parameters())


def _gflops_or_none(name: str, img_size: int, num_classes: int) -> float | None:
    """Forward GFLOPs, or None where the model cannot run at that size (ViT-*/14 at 384px)."""
    spec = parse_model_name(name)
    if spec.family != "resnet" and img_size % spec.stride != 0:
        return None
    return forward_flops(name, img_size=img_size, num_classes=num_classes) / 1e9


def model_rows(resolutions: tuple[int, ...] = (224, 384), num_classes: int = 1000) -> list[dict[str, Any]]:
    """One row per name in `model_names()`: name, family, params, and ``gflops_<res>`` per resolution.

    ``params`` is for the model built at 224px with `num_classes` outputs (ViT position
    embeddings grow with resolution). ``gflops_<res>`` is forward GFLOPs per example, None when
    the resolution is not a multiple of the model's token stride (e.g. ViT-B/14 at 384).
    """
    check(bool(resolutions), "resolutions", "needs at least one resolution")
    for r in resolutions:
        positive_int(r, "resolutions")
    rows = []
    for name in model_names():
        row: dict[str, Any] = {
            "name": name,
            "family": parse_model_name(name).family,
            "params": count_params(name, num_classes=num_classes),
        }
        for res in resolutions:
            row[f"gflops_{res}"] = _gflops_or_none(name, res, num_classes)
        rows.append(row)
    return rows


def flops_summary(
    model: str,
    *,
    resolution: int = 224,
    examples: int | None = None,
    epochs: float = 1.0,
    num_classes: int = 1000,
    masked_patch: tuple[int, int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Compute of training `model` for `epochs` over a dataset of `examples` images.

    Args:
        model: any name `parse_model_name` accepts.
        resolution: square input size (a multiple of the token stride for ViT and hybrids).
        examples: dataset size; None = JFT-300M as the paper counts it (`JFT300M_EXAMPLES`,
            303,000,000).
        epochs: passes over the dataset (may be fractional); examples seen = round(epochs * examples).
        num_classes: classifier width (FLOPs and params).
        masked_patch: (corrupted patches, outputs per patch) when pre-training by masked patch prediction
            (Sec. 4.6): the encoder and its per-patch head are counted instead of the pooled classifier
            (`masked_patch_flops`); None: supervised.
        **options: the model's options (`create_model`'s keywords, e.g. representation_size=768
            for the paper's JFT pre-training head, or shrunk dims), as in a pipeline's `model:`.

    Returns:
        model (canonical), family, resolution, num_classes, params, forward_gflops (per example),
        train_gflops_per_example (3x forward), examples, epochs, examples_seen, train_exaflops
        (total), and breakdown_gflops (forward, per component).
    """
    if examples is None:
        examples = JFT300M_EXAMPLES
    positive_int(examples, "examples")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) or epochs <= 0:
        raise ValueError(f"epochs must be a positive number, got {epochs!r}")
    spec = parse_model_name(model)
    if masked_patch is None:
        parts = flops_breakdown(spec.name, img_size=resolution, num_classes=num_classes, **options)
        params = count_params(spec.name, num_classes=num_classes, img_size=resolution, **options)
    else:
        corrupted, outputs = masked_patch
        parts = masked_patch_flops(spec.name, img_size=resolution, corrupted=corrupted, outputs=outputs, **options)
        encoder = {k: v for k, v in options.items() if k != "representation_size"}
        width = int(options.get("width") or (spec.vit.width if spec.vit is not None else 0))
        # The encoder, its [mask] embedding (D) and the per-patch head (D x outputs + outputs).
        params = count_params(spec.name, num_classes=0, img_size=resolution, **encoder)
        params += width * (outputs + 1) + outputs
    fwd = sum(parts.values())
    # Past a float's range (1.8e308 FLOPs) the count below would end in an OverflowError: refused here instead.
    check(math.isfinite(TRAIN_FLOPS_MULTIPLIER * fwd * float(epochs) * examples), "epochs",
          f"{epochs:g} epochs x {examples:,} examples of {spec.name} is more compute than a float holds "
          f"(over 1.8e308 FLOPs)")
    seen = round(epochs * examples)
    return {
        "model": spec.name,
        "family": spec.family,
        "resolution": resolution,
        "num_classes": num_classes,
        "params": params,
        "forward_gflops": fwd / 1e9,
        "train_gflops_per_example": training_flops(fwd, 1) / 1e9,
        "examples": examples,
        "epochs": float(epochs),
        "examples_seen": seen,
        "train_exaflops": exaflops(training_flops(fwd, seen)),
        "breakdown_gflops": {k: v / 1e9 for k, v in parts.items()},
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def models_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `model_rows` output (human output of ``vitscale models``)."""
    if not rows:
        return "(no models)\n"
    res_keys = [k for k in rows[0] if k.startswith("gflops_")]
    header = ["model", "family", "params (M)", *[f"GFLOPs @{k.removeprefix('gflops_')}" for k in res_keys]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for r in rows:
        cells = [r["name"], r["family"], f"{r['params'] / 1e6:,.1f}", *[_fmt(r[k]) for k in res_keys]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Forward FLOPs per example, 2 per multiply-add, matmuls and convs only (ViT paper "
                 "convention); n/a: resolution not a multiple of the patch size.")
    return "\n".join(lines) + "\n"


def summary_markdown(summary: dict[str, Any]) -> str:
    """Markdown rendering of `flops_summary` output (human output of ``vitscale flops``)."""
    s = summary
    lines = [
        f"## {s['model']} ({s['family']}) at {s['resolution']}px, {s['num_classes']} classes",
        "",
        f"- params: {s['params']:,}",
        f"- forward: {s['forward_gflops']:,.2f} GFLOPs per example",
        f"- training: {s['train_gflops_per_example']:,.2f} GFLOPs per example (3x forward)",
        (f"- {s['epochs']:g} epochs x {s['examples']:,} examples = {s['examples_seen']:,} seen: "
        f"**{s['train_exaflops']:,.2f} exaFLOPs**"),
        "",
        "| component | forward GFLOPs | share |",
        "|---|---:|---:|",
    ]
    total = s["forward_gflops"] or 1.0
    for part, g in s["breakdown_gflops"].items():
        lines.append(f"| {part} | {g:,.3f} | {100 * g / total:.1f}% |")
    return "\n".join(lines) + "\n"
