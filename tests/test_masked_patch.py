"""Masked patch prediction's model and targets (models/masked_patch.py), its config, FLOPs and checks."""

from __future__ import annotations

import pytest
import torch

from vitscale.config.checks import ConfigError
from vitscale.data.corruption import Corruption, corrupted_positions
from vitscale.models import create_model
from vitscale.models.masked_patch import MaskedPatchPredictor, PatchTarget, colour_classes, patch_targets
from vitscale.scaling.flops import flops_breakdown, forward_flops, linear_flops, masked_patch_flops
from vitscale.stages import build_pipeline

TINY = {"depth": 2, "width": 32, "mlp_dim": 64, "heads": 2}


def predictor(target: str = "mean_colour", *, classifier: str = "token", seed: int = 0) -> MaskedPatchPredictor:
    torch.manual_seed(seed)
    encoder = create_model("ViT-Ti/4", num_classes=0, img_size=16, classifier=classifier, **TINY)
    return MaskedPatchPredictor(encoder, PatchTarget(target, patch=4), masked=Corruption(16).counts[1])


def solid(colours: list[tuple[int, int, int]], side: int = 16) -> torch.Tensor:
    """uint8 (len(colours), 3, side, side) images, image i all of colour i."""
    images = torch.tensor(colours, dtype=torch.uint8).reshape(-1, 3, 1, 1).expand(-1, -1, side, side).clone()
    return images


def test_mean_colour_is_the_3_bit_class_of_the_patch_mean() -> None:
    images = solid([(0, 0, 0), (255, 255, 255), (32, 64, 255)])
    images[0, :, :4, :4] = torch.tensor([200, 10, 100], dtype=torch.uint8).reshape(3, 1, 1)
    t = patch_targets(images, PatchTarget("mean_colour", patch=4))
    assert t.shape == (3, 16) and t.dtype == torch.int64
    assert t[1].eq(511).all() and t[2].eq((1 * 8 + 2) * 8 + 7).all()
    assert t[0, 0] == (6 * 8 + 0) * 8 + 3 and t[0, 1:].eq(0).all()  # 200 -> 6, 10 -> 0, 100 -> 3; the rest black


def test_a_patch_of_two_halves_averages_before_quantising() -> None:
    images = solid([(0, 0, 0)])
    images[0, :, :2, :4] = 250  # half the first patch 250, half 0: mean 125 -> level 3
    assert patch_targets(images, PatchTarget("mean_colour", patch=4))[0, 0] == (3 * 8 + 3) * 8 + 3


def test_downsized_targets_are_16_colours_per_patch_in_row_major_cells() -> None:
    images = solid([(0, 0, 0)], side=16)
    images[0, :, 2:4, 0:2] = 255  # patch (0, 0), cell row 1, col 0
    t = patch_targets(images, PatchTarget("downsized_4x4", patch=8))
    assert t.shape == (1, 4, 16)
    assert t[0, 0].tolist() == [0] * 4 + [511] + [0] * 11 and t[0, 1:].eq(0).all()


def test_pixel_targets_are_the_patch_in_the_models_input_scale() -> None:
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    t = patch_targets(images, PatchTarget("pixels", patch=4))
    assert t.shape == (2, 16, 48)
    patch_5 = images[1, :, 4:8, 4:8].permute(1, 2, 0).reshape(-1).float() / 127.5 - 1  # row 1, column 1
    assert torch.allclose(t[1, 5], patch_5)


def test_colour_classes_cover_512_at_3_bits_and_8_at_1_bit() -> None:
    values = torch.arange(256).reshape(1, 1, -1).expand(1, 3, -1)
    assert colour_classes(values, 3).unique().numel() == 8  # grey ramp: 8 levels on the diagonal
    assert colour_classes(torch.tensor([[[255], [0], [255]]]), 1).item() == 5


def test_corruption_masks_swaps_and_keeps_exactly_the_plan() -> None:
    model = predictor()
    tokens = torch.randn(3, 16, 32)
    positions, sources = (torch.from_numpy(a) for a in corrupted_positions(0, 0, ["a", "b", "c"], Corruption(16)))
    out = model.corrupt(tokens, positions, sources)
    for row in range(3):
        masked, swapped = positions[row, :6], positions[row, 6:7]
        assert torch.equal(out[row, masked], model.mask_token.detach().expand(6, -1))
        assert torch.equal(out[row, swapped], tokens[row, sources[row]])
        untouched = [p for p in range(16) if p not in positions[row, :7].tolist()]
        assert torch.equal(out[row, untouched], tokens[row, untouched])  # kept ones and the rest


@pytest.mark.parametrize("target, outputs", [("mean_colour", 512), ("downsized_4x4", 16 * 512), ("pixels", 48)])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_the_predictor_learns_a_fixed_batch(target: str, outputs: int, classifier: str) -> None:
    model = predictor(target, classifier=classifier)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    positions, sources = (torch.from_numpy(a) for a in corrupted_positions(0, 0, list("abcd"), Corruption(16)))
    x, targets = images.float() / 127.5 - 1, patch_targets(images, model.target)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(x, positions, sources)
        loss = model.loss(out, targets, positions)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert out.shape == (4, 8, outputs)
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(p.grad is not None for p in model.parameters())  # nothing unused: ZeRO needs every gradient


def test_the_predictor_takes_only_an_encoder() -> None:
    with pytest.raises(ValueError, match="no classifier"):
        MaskedPatchPredictor(create_model("ViT-Ti/4", num_classes=10, img_size=16, **TINY), PatchTarget(patch=4), 6)
    with pytest.raises(ValueError, match="divisible by 4"):
        PatchTarget("downsized_4x4", patch=6)


def test_flops_count_the_prediction_head_on_the_corrupted_patches_only() -> None:
    parts = masked_patch_flops("ViT-B/16", img_size=224, corrupted=98, outputs=512, representation_size=768)
    encoder = flops_breakdown("ViT-B/16", img_size=224, num_classes=0)
    assert parts["patch_prediction"] == linear_flops(98, 768, 512)
    assert {k: v for k, v in parts.items() if k != "patch_prediction"} == {
        k: v for k, v in encoder.items() if k not in ("pre_logits", "head")}
    supervised = forward_flops("ViT-B/16", img_size=224, num_classes=18_000, representation_size=768)
    # Table-6 accounting of the same encoder: the per-patch head replaces the pooled pre-logits and classifier.
    pooled = linear_flops(1, 768, 768) + linear_flops(1, 768, 18_000)
    assert sum(parts.values()) - supervised == linear_flops(98, 768, 512) - pooled


def pipeline(**train: object) -> dict[str, object]:
    return {"model": {"name": "ViT-Ti/4", "img_size": 16, **TINY}, "data": {"url": "unused"},
            "train": {"objective": "masked_patch", "global_batch": 8, "micro_batch": 8, **train},
            "cluster": {"num_workers": 1, "use_gpu": False}}


@pytest.mark.parametrize("train, key", [
    ({"objective": "masked"}, "train.objective"),
    ({"masked_patch": {"target": "colour"}}, "train.masked_patch.target"),
    ({"masked_patch": {"mask": 0.9, "swap": 0.2}}, "train.masked_patch.swap"),
    ({"masked_patch": {"corrupt": 0}}, "train.masked_patch.corrupt"),
    ({"masked_patch": {"bits": 9}}, "train.masked_patch.bits"),
    ({"masked_patch": {"bits": 5}}, "train.masked_patch.bits"),  # a head of 32,768 classes per colour
    ({"masked_patch": {"corrupt": 0.01}}, "train.masked_patch.corrupt"),  # 0.16 of 16 patches: none
    ({"masked_patch": {"maks": 0.8}}, "train.masked_patch.maks"),
])
def test_bad_settings_name_their_key(train: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline(pipeline(**train))
    assert err.value.key == key, str(err.value)


def test_a_resnet_or_a_grid_the_target_cannot_cut_is_refused() -> None:
    raw = pipeline()
    raw["model"] = {"name": "R50x1", "img_size": 32}
    with pytest.raises(ConfigError, match="ResNet") as err:
        build_pipeline(raw)
    assert err.value.key == "train.objective"
    raw["model"] = {"name": "R50x1+ViT-Ti/16", "img_size": 32}  # its stem shows a patch to its neighbours
    with pytest.raises(ConfigError, match="hybrid") as err:
        build_pipeline(raw)
    assert err.value.key == "train.objective"
    raw["model"] = {"name": "ViT-Ti/8", "img_size": 8, **TINY}  # one patch: nothing to swap it with
    raw["train"] = {**raw["train"], "masked_patch": {"mask": 0.0, "swap": 1.0}}  # type: ignore[dict-item]
    with pytest.raises(ConfigError) as err:
        build_pipeline(raw)
    assert err.value.key == "train.masked_patch.swap"
    raw["train"] = {**raw["train"], "masked_patch": {}}  # type: ignore[dict-item]
    raw["model"] = {"name": "ViT-Ti/8", "img_size": 16, **TINY}
    raw["train"] = {**raw["train"], "masked_patch": {"target": "downsized_4x4"}}  # type: ignore[dict-item]
    build_pipeline(raw)  # 8-pixel patches cut into 4 x 4 cells of 2
    raw["model"] = {"name": "ViT-Ti/6", "img_size": 12, **TINY}  # 6-pixel patches: no 4 x 4 cells
    with pytest.raises(ConfigError) as err:
        build_pipeline(raw)
    assert err.value.key == "train.masked_patch.target"


def test_fine_tuning_refuses_the_pre_training_objective() -> None:
    raw = pipeline()
    raw["finetune"] = {"data": {"url": "digits"}, "train": {"objective": "masked_patch", "base_lr": 0.01}}
    with pytest.raises(ConfigError) as err:
        build_pipeline(raw)
    assert err.value.key == "finetune.train.objective"


@pytest.mark.parametrize("argv, flag", [
    (["R50x1", "--objective", "masked_patch"], "--objective"),
    (["R50x1+ViT-B/16", "--objective", "masked_patch"], "--objective"),  # the stem leaks neighbours' pixels
    (["ViT-H/14", "--objective", "masked_patch", "--target", "downsized_4x4"], "--target"),
    (["ViT-B/16", "--target", "pixels"], "--target"),  # without the objective: the supervised figures
    (["ViT-B/16", "--resolution", "100"], "--resolution"),
    (["ViT-X/16"], "MODEL"),
    (["ViT-B/16", "--resolution", str(2**40)], "--resolution"),  # past MAX_RESOLUTION, before any tensor is sized
    (["ViT-B/16", "--option", f"width={2**40}", "--option", "heads=1"], "MODEL"),  # no tensor takes its sizes
    (["ViT-B/16", "--option", "depth=-1"], "--option depth"),
    (["ViT-B/16", "--epochs", "-1"], "--epochs"),
    (["ViT-B/16", "--classes", "-1"], "--classes"),
])
def test_vitscale_flops_refuses_bad_arguments_in_one_line(argv: list[str], flag: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.cli import main

    assert main(["flops", *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"vitscale: error: {flag}: "), lines


def test_vitscale_flops_prices_the_objective(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from vitscale.cli import main

    assert main(["flops", "ViT-B/16", "--objective", "masked_patch", "--epochs", "14", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["breakdown_gflops"]["patch_prediction"] == pytest.approx(linear_flops(98, 768, 512) / 1e9)
    assert "head" not in summary["breakdown_gflops"]
    encoder = sum(v for k, v in flops_breakdown("ViT-B/16", num_classes=0).items())
    assert summary["forward_gflops"] == pytest.approx((encoder + linear_flops(98, 768, 512)) / 1e9)
