"""What a training step optimises: the labels (`supervised`) or the images themselves (`masked_patch`).

`train.objective` picks one (`TrainConfig`); everything that differs between them is here, once: the
model the engine trains (`build_model`), what the loader adds to each batch (`corruption`: the corrupted
positions of masked patch prediction), FLOPs per example (the objective's head counted), and the loss of
a micro-batch (`Objective.loss`, with the rows a corrupt sample refilled left out). The step
(`train/step.py`) calls the objective and does not know which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from vitscale.config.checks import ConfigError, check
from vitscale.data.corruption import Corruption
from vitscale.models.config import ModelConfig
from vitscale.train.config import MaskedPatchConfig, TrainConfig
from vitscale.train.losses import LossKind, classification_loss

if TYPE_CHECKING:
    from vitscale.models.masked_patch import PatchTarget

__all__ = ["MaskedPatch", "Objective", "Supervised", "checked_masked_patch_plan", "encoder_config",
           "masked_patch_plan", "objective_flops", "objective_for"]


def encoder_config(model: ModelConfig) -> ModelConfig:
    """The model section of a masked patch run's encoder: no pre-logits (its head is per patch, not pooled)."""
    return replace(model, options={k: v for k, v in model.options.items() if k != "representation_size"})


SETTING_KEYS = {"rate": "corrupt", "mask": "mask", "swap": "swap"}
"""`data/corruption.py`'s names for the settings of `train.masked_patch`."""


def checked_masked_patch_plan(model: ModelConfig, settings: MaskedPatchConfig) -> tuple[Corruption, PatchTarget]:
    """`masked_patch_plan`, or a `ConfigError` naming the key at fault: the model must be a ViT (it needs patch
    embeddings to corrupt) whose grid and patch size the corruption and the target fit."""
    from vitscale.data.corruption import CorruptionError
    from vitscale.models.variants import parse_model_name

    family = parse_model_name(model.name).family
    # A hybrid's ResNet stem mixes each patch's pixels into its neighbours' embeddings (overlapping
    # receptive fields): a corrupted patch's colour would reach the encoder through the patches beside it.
    check(family == "vit", "train.objective",
          f"masked_patch corrupts a ViT's patch embeddings; model.name {model.name!r} is a "
          + ("ResNet" if family == "resnet" else "hybrid, whose ResNet stem shows each patch to its neighbours"))
    where = f"(model {model.name} at model.img_size {model.img_size})"
    try:
        return masked_patch_plan(model, settings)
    except CorruptionError as exc:
        raise ConfigError(f"train.masked_patch.{SETTING_KEYS[exc.setting]}", f"{exc} {where}") from None
    except ValueError as exc:  # the target cannot be cut from this patch size (the rest is checked by the config)
        raise ConfigError("train.masked_patch.target", f"{exc} {where}") from None


def masked_patch_plan(model: ModelConfig, settings: MaskedPatchConfig) -> tuple[Corruption, PatchTarget]:
    """(what is corrupted, what is predicted) for `model`'s token grid and stride (built on the meta device)."""
    from vitscale.models.masked_patch import PatchTarget

    with torch.device("meta"):
        encoder = encoder_config(model).build(0)
    grid, stride = encoder.cfg.grid, int(encoder.patch_embed.stride)
    corruption = Corruption(grid[0] * grid[1], settings.corrupt, settings.mask, settings.swap)
    return corruption, PatchTarget(settings.target, patch=stride, bits=settings.bits)


@dataclass(frozen=True)
class Supervised:
    """The labels, by `train.loss` with `train.label_smoothing` (Sec. 4.1-4.5)."""

    train: TrainConfig
    corruption: None = None
    """Nothing for the loader to add."""

    def build_model(self, model: ModelConfig, num_classes: int) -> torch.nn.Module:
        return model.build(num_classes)

    def loss(self, engine: Any, pixels: torch.Tensor, images: torch.Tensor,
             micro: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss over the valid rows, None): see `Objective.loss`."""
        logits = engine(images)
        labels = micro["label"].to(logits.device, non_blocking=True)
        keep = _kept_rows(micro, logits.device)
        if keep is not None:
            if not bool(keep.any()):
                return logits.sum() * 0.0, None
            logits, labels = logits[keep], labels[keep]
        return classification_loss(logits, labels, kind=cast(LossKind, self.train.loss),
                                    label_smoothing=self.train.label_smoothing), None


@dataclass(frozen=True)
class MaskedPatch:
    """Masked patch prediction (Sec. 4.6): the loss over each image's corrupted patches."""

    train: TrainConfig
    corruption: Corruption
    target: PatchTarget

    def build_model(self, model: ModelConfig, num_classes: int) -> torch.nn.Module:
        """The encoder (no classifier, no pre-logits) inside a `MaskedPatchPredictor`; labels are not read."""
        from vitscale.models.masked_patch import MaskedPatchPredictor

        return MaskedPatchPredictor(encoder_config(model).build(0), self.target, masked=self.corruption.counts[1])

    def loss(self, engine: Any, pixels: torch.Tensor, images: torch.Tensor,
             micro: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss over the valid rows' corrupted patches, (hits, predicted patches) of those rows; None for
        the pixel regression)."""
        from vitscale.models.masked_patch import patch_targets

        positions = micro["positions"].to(images.device, non_blocking=True)
        sources = micro["sources"].to(images.device, non_blocking=True)
        predictions = engine(images, positions, sources)  # (B, corrupted, outputs)
        targets = patch_targets(pixels, self.target)
        keep = _kept_rows(micro, images.device)
        if keep is not None:
            if not bool(keep.any()):
                return predictions.sum() * 0.0, torch.zeros(2, device=images.device)
            predictions, targets, positions = predictions[keep], targets[keep], positions[keep]
        predictor = getattr(engine, "module", engine)  # the DeepSpeed engine's model, or a bare one
        loss = predictor.loss(predictions, targets, positions)
        if not self.target.classifies:  # a regression (pixels) has no exact hit to count
            return loss, None
        with torch.no_grad():
            hits = predictor.hits(predictions, targets, positions)
            # The count is known on the host: a fill on the device, not a copy from pageable memory each micro-step.
            tally = torch.stack([hits.sum().float(), hits.new_full((), hits.numel(), dtype=torch.float32)])
        return loss, tally


Objective = Supervised | MaskedPatch
"""Either objective: `build_model`, `corruption` (what the loader adds to each sample, or None), `loss`."""


def objective_for(train: TrainConfig, model: ModelConfig) -> Objective:
    """The objective `train.objective` names, for `model`."""
    if train.objective == "masked_patch":
        corruption, target = masked_patch_plan(model, train.masked_patch)
        return MaskedPatch(train, corruption, target)
    return Supervised(train)


def objective_flops(objective: Objective, model: ModelConfig, num_classes: int) -> int:
    """Forward FLOPs per example of `model` trained by `objective`, its head counted (`scaling/flops.py`)."""
    from vitscale.scaling.flops import forward_flops, masked_patch_flops

    if isinstance(objective, MaskedPatch):
        corrupted = objective.corruption.counts[0]
        return sum(masked_patch_flops(model.name, img_size=model.img_size, corrupted=corrupted,
                                      outputs=objective.target.outputs, **model.options).values())
    return forward_flops(model.name, img_size=model.img_size, num_classes=num_classes, **model.options)


def _kept_rows(micro: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The rows holding real samples, or None when all do.

    The stream keeps every batch full so ranks stay in lock-step; rows refilled after a corrupt sample
    are marked invalid and must not train the model. A batch with no valid row still runs backward (a
    zero loss) so every rank joins the same collectives.
    """
    valid = micro.get("valid")
    if valid is None or bool(valid.all()):
        return None
    return valid.to(device)
