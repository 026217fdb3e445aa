"""Analytic compute of every vitscale model, in the ViT paper's exaFLOPs convention.

Convention (Dosovitskiy et al., ICLR 2021, Sec. 4.4 / Table 6):

- a multiply-add is 2 FLOPs;
- every matrix product and convolution of the forward pass is counted, including both
  attention products (q·kᵀ and A·v); element-wise work (biases, norms, softmax, GELU, pooling,
  weight standardisation, position-embedding adds) is ignored;
- a training step costs 3x the forward pass (forward + backward w.r.t. activations and weights);
- total = per-example training FLOPs x examples seen (epochs x dataset size).

One detail the paper does not state, found by reproducing its Table 6: convolution
multiply-adds that land on zero padding are NOT counted. The paper's figures came from XLA's
cost analysis, which counts only in-bounds kernel taps (``HloCostAnalysis::GetConvolutionFlops``,
tensorflow/tensorflow ``third_party/xla/xla/service/hlo_cost_analysis.cc``). With that rule every
ResNet row of Table 6 matches to <1%; counting padded taps too (what
``torch.utils.flop_counter.FlopCounterMode`` does) overshoots every ResNet row by 3-4%. ViTs are
unaffected (their only conv is the unpadded patch embedding). ``count_padding=True`` gives the
dense count.

Pure functions of the model spec (`vitscale.models.variants`, pure data); no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitscale.config.checks import image_side, non_negative_int, one_of, positive_int
from vitscale.models.options import CLASSIFIERS, DIM_OPTIONS, check_option_names
from vitscale.models.variants import (
    ModelSpec,
    ResNetDims,
    ViTDims,
    parse_model_name,
    with_overrides,
)

FLOPS_PER_MAC = 2
"""A multiply-add counts as 2 FLOPs (paper convention, and FlopCounterMode's)."""
TRAIN_FLOPS_MULTIPLIER = 3
"""Training step = forward + backward (~2x forward) = 3x the forward FLOPs."""
JFT300M_EXAMPLES = 303_000_000
"""JFT-300M size as the paper states it (Sec. 4.1: "303M high-resolution images"). With it the
ViT rows of Table 6 are reproduced to <0.25%, which 300M does not (-1%)."""
JFT_NUM_CLASSES = 18_291
"""JFT-300M label-space size (BiT, Kolesnikov et al. 2020); the pre-training head's width."""
IN_CHANS = 3
"""RGB input; `create_model` always builds 3-channel stems."""

# Of the model's options only the dims, `classifier` and `representation_size` change compute.
# Every other model option (position embeddings, dropout, head bias, activation checkpointing)
# changes no matmul or conv: accepted, so callers pass the same options to `create_model` and here,
# and ignored. Activation checkpointing re-runs the forward in backward (hardware FLOPs ~4x);
# the paper's model-FLOPs convention stays at 3x.


# --------------------------------------------------------------------------------------------
# Primitive counts
# --------------------------------------------------------------------------------------------


def linear_flops(tokens: int, d_in: int, d_out: int) -> int:
    """(tokens, d_in) @ (d_in, d_out): 2 * tokens * d_in * d_out (bias add ignored)."""
    return FLOPS_PER_MAC * tokens * d_in * d_out


def _valid_taps_1d(in_size: int, kernel: int, stride: int, pad_lo: int, out_size: int) -> int:
    """Number of (output position, kernel tap) pairs along one axis whose input index is real.

    Output o, tap j reads input o*stride - pad_lo + j; it counts when that lies in [0, in_size).
    """
    total = 0
    for j in range(kernel):
        # o*stride >= pad_lo - j  and  o*stride <= in_size - 1 + pad_lo - j
        lo = max(0, -(-(pad_lo - j) // stride))
        hi = min(out_size - 1, (in_size - 1 + pad_lo - j) // stride)
        total += max(0, hi - lo + 1)
    return total


def conv2d_flops(
    in_size: int,
    in_ch: int,
    out_ch: int,
    kernel: int,
    stride: int,
    pad: tuple[int, int],
    *,
    count_padding: bool = False,
) -> tuple[int, int]:
    """FLOPs and output size of a square conv on a square (in_ch, in_size, in_size) input.

    Args:
        pad: zero padding (before, after) on each spatial axis.
        count_padding: False (paper/XLA convention): only multiply-adds on real input pixels;
            True: dense out² * kernel² * in_ch * out_ch (what FlopCounterMode reports).

    Returns:
        (flops, out_size) with out_size = (in_size + before + after - kernel) // stride + 1.
    """
    lo, hi = pad
    out = (in_size + lo + hi - kernel) // stride + 1
    if out < 1:
        raise ValueError(f"conv {kernel}x{kernel}/{stride} on a {in_size}px input gives no output; use a larger image")
    taps = out * kernel if count_padding else _valid_taps_1d(in_size, kernel, stride, lo, out)
    # Square input and kernel: the 2-D tap count is the product of the two equal 1-D counts.
    return FLOPS_PER_MAC * taps * taps * in_ch * out_ch, out


def _same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF "SAME" padding (before, after): output ceil(size / stride), extra pixel after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad(size: int, kernel: int, stride: int, same: bool) -> tuple[int, int]:
    # Pre-act BiT convs pad kernel // 2 on both sides (PyTorch style); post-act hybrid convs use SAME.
    return _same_pad(size, kernel, stride) if same else (kernel // 2, kernel // 2)


# --------------------------------------------------------------------------------------------
# Model parts
# --------------------------------------------------------------------------------------------


def attention_product_flops(tokens: int, width: int) -> int:
    """One layer's q·kᵀ and A·v (Sec. 3.1, MSA): heads x (T x D_h)(D_h x T) and heads x (T x T)(T x D_h).

    Summed over heads, each is T² · D multiply-adds (heads · D_h = D), so 4 · T² · D FLOPs,
    independent of the number of heads.
    """
    return 2 * FLOPS_PER_MAC * tokens * tokens * width


def vit_encoder_flops(dims: ViTDims, tokens: int) -> dict[str, int]:
    """Encoder FLOPs over all L blocks for a sequence of `tokens` (Eq. 2-3), by component.

    Per block, with T tokens, width D, MLP width M:
      attention_projections: [q,k,v] = z U_qkv (T·D·3D MACs) + output projection (T·D·D)  (Eq. 2)
      attention_products:    q·kᵀ and A·v, 2 · T²·D MACs                                  (Eq. 2)
      mlp:                   two dense layers, 2 · T·D·M MACs                             (Eq. 3)
    LayerNorms, residual adds, softmax and GELU are element-wise: not counted.
    """
    t, d, m, depth = tokens, dims.width, dims.mlp_dim, dims.depth
    return {
        "attention_projections": depth * (linear_flops(t, d, 3 * d) + linear_flops(t, d, d)),
        "attention_products": depth * attention_product_flops(t, d),
        "mlp": depth * (linear_flops(t, d, m) + linear_flops(t, m, d)),
    }


def vit_head_flops(width: int, representation_size: int | None, num_classes: int) -> dict[str, int]:
    """Head on the one pooled vector (class token's output or GAP, Eq. 4): optional pre-logits
    D -> R (tanh hidden layer of the pre-training head), then the R (or D) -> K classifier."""
    pre = linear_flops(1, width, representation_size) if representation_size else 0
    return {"pre_logits": pre, "head": linear_flops(1, representation_size or width, num_classes)}


def resnet_flops(dims: ResNetDims, img_size: int, *, count_padding: bool = False) -> tuple[dict[str, int], int]:
    """BiT ResNet-v2 trunk FLOPs by part ("stem", "stage1", ...) and the final feature-map size.

    Root: 7x7/2 conv 3 -> 64w, then a 3x3/2 max-pool (no FLOPs; total stride 4). Each bottleneck
    unit: 1x1 (C_in -> C/4), 3x3 with the stage's stride (C/4 -> C/4), 1x1 (C/4 -> C); the first
    unit of every stage adds a 1x1 projection shortcut C_in -> C with the same stride. Stage i
    (from 0) has C = 256·w·2^i and stride 2 except stage 0. GroupNorm, ReLU and weight
    standardisation are element-wise. Padding follows the model: kernel // 2 on both sides for
    pre-activation units (standalone BiT), TF "SAME" for the post-activation hybrid backbone.
    """
    same = not dims.preact
    parts: dict[str, int] = {}
    parts["stem"], h = conv2d_flops(
        img_size, IN_CHANS, dims.stem_width, 7, 2, _pad(img_size, 7, 2, same), count_padding=count_padding
    )
    # Max-pool 3x3/2: BiT pads 1 on both sides, the hybrid pads SAME; both give ceil(h / 2) here.
    h = (h + 2 - 3) // 2 + 1 if not same else -(-h // 2)
    in_ch = dims.stem_width
    for i, (units, out_ch) in enumerate(zip(dims.layers, dims.stage_widths)):
        mid, stage = out_ch // 4, 0
        for u in range(units):
            stride = 2 if (u == 0 and i > 0) else 1
            f1, _ = conv2d_flops(h, in_ch, mid, 1, 1, (0, 0), count_padding=count_padding)
            f2, h_out = conv2d_flops(h, mid, mid, 3, stride, _pad(h, 3, stride, same), count_padding=count_padding)
            f3, _ = conv2d_flops(h_out, mid, out_ch, 1, 1, (0, 0), count_padding=count_padding)
            stage += f1 + f2 + f3
            if stride != 1 or in_ch != out_ch:  # projection shortcut on the unit's input
                stage += conv2d_flops(h, in_ch, out_ch, 1, stride, (0, 0), count_padding=count_padding)[0]
            h, in_ch = h_out, out_ch
        parts[f"stage{i + 1}"] = stage
    return parts, h


# --------------------------------------------------------------------------------------------
# Whole models by name
# --------------------------------------------------------------------------------------------


def _resolve(name: str, **overrides: Any) -> tuple[ModelSpec, str, int | None]:
    """(spec with dim overrides applied, classifier, representation_size) for `name`.

    ValueError for an unknown name, an unknown override, or one that does not apply.
    """
    spec = parse_model_name(name)
    check_option_names(overrides, spec.family, spec.name)  # the model's own list of options
    spec = with_overrides(spec, **{k: overrides[k] for k in DIM_OPTIONS if k in overrides})
    classifier = overrides.get("classifier", "token")
    rep = overrides.get("representation_size")
    if spec.family == "resnet":  # check_option_names refused ViT-only options on a ResNet
        return spec, "gap", None
    one_of(classifier, CLASSIFIERS, "classifier")
    if rep is not None:
        positive_int(rep, "representation_size")
    return spec, classifier, rep


def flops_breakdown(
    name: str, *, img_size: int = 224, num_classes: int = 1000, count_padding: bool = False, **overrides: Any
) -> dict[str, int]:
    """Forward FLOPs per example of model `name`, by component (values sum to `forward_flops`).

    Keys, in forward order:
      ViT:    patch_embed, attention_projections, attention_products, mlp, pre_logits, head
      ResNet: stem, stage1 ... stageN, head
      hybrid: stem, stage1 ... stageN (the CNN), patch_embed (1x1 conv on the feature map),
              then the ViT keys.

    Args:
        name: any name `vitscale.models.parse_model_name` accepts ("ViT-B/16", "R50x1", ...).
        img_size: square input resolution. ViT and hybrids need a multiple of the token stride
            (as the models do); ResNets take any size.
        num_classes: classifier width (JFT pre-training: `JFT_NUM_CLASSES`).
        count_padding: count conv multiply-adds on zero padding (see module docstring).
        **overrides: the model's options, the same keywords as `create_model`
            (`models/options.py`); only dims, classifier and representation_size change compute.
    """
    image_side(img_size, "img_size")
    non_negative_int(num_classes, "num_classes")  # 0: an encoder without a classifier
    spec, classifier, rep = _resolve(name, **overrides)
    parts: dict[str, int] = {}
    if spec.family == "resnet":
        dims = spec.resnet
        if dims is None:
            raise ValueError(f"{spec.name} has no ResNet dims")
        trunk, _ = resnet_flops(dims, img_size, count_padding=count_padding)
        parts.update(trunk)
        # Global average pool (element-wise) then the C -> K linear head.
        parts["head"] = linear_flops(1, dims.out_channels, num_classes)
        return parts
    vit, patch = spec.vit, spec.patch_size
    if vit is None or patch is None:
        raise ValueError(f"{spec.name} has no ViT dims")
    n_patches = spec.num_patches(img_size)  # ValueError if img_size is not a multiple of the stride
    if spec.family == "hybrid":
        if spec.resnet is None:
            raise ValueError(f"{spec.name} has no ResNet dims")
        trunk, fmap = resnet_flops(spec.resnet, img_size, count_padding=count_padding)
        parts.update(trunk)
        in_ch, grid_in = spec.resnet.out_channels, fmap
    else:
        in_ch, grid_in = IN_CHANS, img_size
    # Eq. 1, x_p E: each of the N patches (P²·C values) is projected to D. The embedding is a
    # conv with kernel = stride = P and no padding, so every tap is real.
    parts["patch_embed"], grid = conv2d_flops(grid_in, in_ch, vit.width, patch, patch, (0, 0))
    if grid * grid != n_patches:
        raise ValueError(f"{spec.name}: feature grid {grid}x{grid} != {n_patches} patches at {img_size}px")
    tokens = n_patches + (1 if classifier == "token" else 0)  # class token joins the sequence
    parts.update(vit_encoder_flops(vit, tokens))
    parts.update(vit_head_flops(vit.width, rep, num_classes))
    return parts


def forward_flops(
    name: str, *, img_size: int = 224, num_classes: int = 1000, count_padding: bool = False, **overrides: Any
) -> int:
    """Forward FLOPs per example (2 per multiply-add); see `flops_breakdown` for the arguments."""
    return sum(
        flops_breakdown(name, img_size=img_size, num_classes=num_classes, count_padding=count_padding, **overrides)
        .values()
    )


def masked_patch_flops(name: str, *, img_size: int, corrupted: int, outputs: int, **overrides: Any) -> dict[str, int]:
    """Forward FLOPs per example of masked patch prediction (Sec. 4.6), by component.

    The encoder's keys as `flops_breakdown` gives them for a ViT without a classifier or pre-logits, then
    ``patch_prediction``: the linear head D -> `outputs` on each of the `corrupted` patches' output tokens
    (512 outputs for the 3-bit mean colour, 16 x 512 for the 4 x 4 downsizing, P x P x 3 for the pixels).
    Replacing embeddings by [mask] or another patch's is a copy: not counted.
    """
    non_negative_int(corrupted, "corrupted")
    positive_int(outputs, "outputs")
    encoder = {k: v for k, v in overrides.items() if k != "representation_size"}
    parts = flops_breakdown(name, img_size=img_size, num_classes=0, **encoder)
    parts.pop("pre_logits", None), parts.pop("head", None)  # both 0: no pooled head
    spec, _, _ = _resolve(name, **encoder)
    if spec.vit is None:
        raise ValueError(f"{spec.name} is not a ViT: masked patch prediction corrupts a ViT's patch embeddings")
    parts["patch_prediction"] = linear_flops(corrupted, spec.vit.width, outputs)
    return parts


def training_flops(forward_flops_per_example: int, examples: int) -> int:
    """Total training FLOPs: 3 x forward per example x examples seen (epochs x dataset size)."""
    non_negative_int(forward_flops_per_example, "forward_flops_per_example")
    non_negative_int(examples, "examples")
    return TRAIN_FLOPS_MULTIPLIER * forward_flops_per_example * examples


def exaflops(flops: float) -> float:
    """FLOPs -> exaFLOPs (1e18), the unit of Table 6 and Figure 5."""
    return float(flops) / 1e18


# --------------------------------------------------------------------------------------------
# The paper's published compute (Table 6)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperComputeRow:
    """One row of the paper's Table 6: a JFT-300M pre-training run and its compute."""

    model: str
    """vitscale canonical name (the paper prints "ResNet50x1" for R50x1)."""
    epochs: int
    """Pre-training epochs on JFT-300M at 224px."""
    exaflops: float
    """Pre-training compute as published."""


PAPER_TABLE6: tuple[PaperComputeRow, ...] = tuple(
    PaperComputeRow(m, e, x)
    for m, e, x in (
        ("ViT-B/32", 7, 55), ("ViT-B/16", 7, 224), ("ViT-L/32", 7, 196), ("ViT-L/16", 7, 783),
        ("ViT-L/16", 14, 1567), ("ViT-H/14", 14, 4262),
        ("R50x1", 7, 50), ("R50x2", 7, 199), ("R101x1", 7, 96), ("R152x1", 7, 141),
        ("R152x2", 7, 563), ("R152x2", 14, 1126), ("R200x3", 14, 3306),
        ("R50x1+ViT-B/32", 7, 106), ("R50x1+ViT-B/16", 7, 274), ("R50x1+ViT-L/32", 7, 246),
        ("R50x1+ViT-L/16", 7, 859), ("R50x1+ViT-L/16", 14, 1668),
    )
)
"""Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021, arXiv:2010.11929v2, App. C,
Table 6 ("Detailed results of model scaling experiments", exaFLOPs column). v2's arXiv comment
notes the exaFLOPs of Figure 5 / Table 6 were corrected from v1. Hybrid "/16" and "/32" are the
ResNet's total stride (stage 4 folded into stage 3 vs. the full R50). Known inconsistency in
the paper itself: R50x1+ViT-L/16 7ep (859) is not half of its 14ep row (1668 = 2 x 834), while
every other 7/14-epoch pair is exactly 1:2; vitscale gives 832 / 1665."""


def paper_pretraining_overrides(model: str) -> dict[str, Any]:
    """The pre-training head of the paper's JFT runs: ViT/hybrid have a pre-logits layer of width D."""
    spec = parse_model_name(model)
    return {"representation_size": spec.vit.width} if spec.vit is not None else {}


def reproduce_table6(
    *, examples: int = JFT300M_EXAMPLES, num_classes: int = JFT_NUM_CLASSES, count_padding: bool = False
) -> list[dict[str, Any]]:
    """vitscale's exaFLOPs for every Table 6 row (224px, JFT head, pre-logits) vs. the paper's.

    Returns one dict per row: model, epochs, paper_exaflops, exaflops, rel_error (ours/paper - 1).
    """
    rows = []
    for row in PAPER_TABLE6:
        fwd = forward_flops(
            row.model, img_size=224, num_classes=num_classes, count_padding=count_padding,
            **paper_pretraining_overrides(row.model),
        )
        ours = exaflops(training_flops(fwd, row.epochs * examples))
        rows.append({"model": row.model, "epochs": row.epochs, "paper_exaflops": row.exaflops,
                     "exaflops": ours, "rel_error": ours / row.exaflops - 1.0})
    return rows
