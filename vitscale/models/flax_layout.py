"""The official Flax and BiT `.npz` layouts (google-research/vision_transformer, big_transfer, big_vision) and
vitscale's PyTorch names: one rule per parameter, read both ways.

A rule names a PyTorch state-dict entry, the npz entries it is made of, and the two conversions: Flax dense
kernels are (in, out) where torch's are (out, in), convolutions HWIO where torch's are OIHW, and attention keeps
query, key and value apart with a heads axis where the model fuses them into one `qkv`. `npz_to_state_dict`
reads a file's arrays by the model's rules (`weights_files.load_pretrained`); `npz_arrays` writes a model's
weights by the same rules (`weights_files.export_npz`), so a round trip is exact. Parameters with no official
counterpart (2-D, per-layer and relative position tables) travel as ``vitscale/<name>`` in PyTorch layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor, nn

from vitscale.models.hybrid import HybridEmbed
from vitscale.models.resnet import ResNetStage, ResNetV2
from vitscale.models.vit import VisionTransformer

__all__ = ["EXTRA_PREFIX", "npz_arrays", "npz_to_state_dict", "official_npz_names", "rules_for", "weights_array"]

EXTRA_PREFIX = "vitscale/"
"""The npz entries of parameters the official layouts have no name for (``vitscale/<PyTorch name>``)."""


@dataclass(frozen=True)
class _Rule:
    name: str  # PyTorch state-dict key
    keys: tuple[str, ...]  # npz keys
    to_torch: Callable[[list[np.ndarray]], np.ndarray]
    to_npz: Callable[[np.ndarray], list[np.ndarray]]


def _same(name: str, key: str) -> _Rule:
    return _Rule(name, (key,), lambda a: a[0], lambda w: [w])


def _vector(name: str, key: str) -> _Rule:  # norms: some files store (1, 1, 1, C)
    return _Rule(name, (key,), lambda a: a[0].reshape(-1), lambda w: [w])


def _dense(name: str, key: str) -> _Rule:  # Flax (in, out) <-> torch (out, in)
    return _Rule(name, (key,), lambda a: a[0].T, lambda w: [w.T])


def _conv(name: str, key: str) -> _Rule:  # HWIO <-> OIHW
    return _Rule(name, (key,), lambda a: a[0].transpose(3, 2, 0, 1), lambda w: [w.transpose(2, 3, 1, 0)])


def _attention_rules(name: str, prefix: str, heads: int) -> list[_Rule]:
    """Fused qkv (3D, D) <-> query/key/value kernels (D, heads, Dh); out (heads, Dh, D)."""
    qkv = tuple(f"{prefix}{n}/kernel" for n in ("query", "key", "value"))
    qkv_b = tuple(f"{prefix}{n}/bias" for n in ("query", "key", "value"))

    def qkv_to_npz(w: np.ndarray) -> list[np.ndarray]:
        d = w.shape[1]
        return [p.reshape(heads, -1, d).transpose(2, 0, 1) for p in np.split(w, 3, axis=0)]

    def fits(a: list[np.ndarray], axis: int) -> list[np.ndarray]:
        # A file of another head count reshapes to the same matrix, but splits it into other heads: a model
        # whose attention computes something else. Refused (the caller names the entries), never loaded.
        for k in a:
            if k.ndim <= axis or k.shape[axis] != heads:
                raise ValueError(f"{tuple(k.shape)} is not {heads} heads (the model's)")
        return a

    def out_to_torch(a: list[np.ndarray]) -> np.ndarray:
        k = fits(a, 0)[0]
        return k.reshape(-1, k.shape[-1]).T

    return [
        _Rule(f"{name}.qkv.weight", qkv, lambda a: np.concatenate([k.reshape(k.shape[0], -1).T for k in fits(a, 1)]),
              qkv_to_npz),
        _Rule(f"{name}.qkv.bias", qkv_b, lambda a: np.concatenate([b.reshape(-1) for b in fits(a, 0)]),
              lambda w: [p.reshape(heads, -1) for p in np.split(w, 3)]),
        _Rule(f"{name}.proj.weight", (f"{prefix}out/kernel",), out_to_torch,
              lambda w: [w.T.reshape(heads, -1, w.shape[0])]),
        _same(f"{name}.proj.bias", f"{prefix}out/bias"),
    ]


def _vit_rules(model: VisionTransformer) -> list[_Rule]:
    rules = [_conv("patch_embed.proj.weight", "embedding/kernel"), _same("patch_embed.proj.bias", "embedding/bias")]
    if model.cls_token is not None:
        rules.append(_same("cls_token", "cls"))
    if model.pos_embed is not None and model.pos_embed.shape[0] == 1:
        rules.append(_same("pos_embed", "Transformer/posembed_input/pos_embedding"))
    final = "norm" if isinstance(model.norm, nn.LayerNorm) else "fc_norm"
    rules += [_same(f"{final}.weight", "Transformer/encoder_norm/scale"),
              _same(f"{final}.bias", "Transformer/encoder_norm/bias")]
    for i in range(len(model.blocks)):
        b, p = f"blocks.{i}", f"Transformer/encoderblock_{i}/"
        rules += [_same(f"{b}.norm1.weight", f"{p}LayerNorm_0/scale"), _same(f"{b}.norm1.bias", f"{p}LayerNorm_0/bias"),
                  _same(f"{b}.norm2.weight", f"{p}LayerNorm_2/scale"), _same(f"{b}.norm2.bias", f"{p}LayerNorm_2/bias")]
        rules += _attention_rules(f"{b}.attn", f"{p}MultiHeadDotProductAttention_1/", model.cfg.dims.heads)
        for r in range(2):
            rules += [_dense(f"{b}.mlp.fc{r + 1}.weight", f"{p}MlpBlock_3/Dense_{r}/kernel"),
                      _same(f"{b}.mlp.fc{r + 1}.bias", f"{p}MlpBlock_3/Dense_{r}/bias")]
    rules += [_dense("pre_logits.fc.weight", "pre_logits/kernel"), _same("pre_logits.fc.bias", "pre_logits/bias"),
              _dense("head.weight", "head/kernel"), _same("head.bias", "head/bias")]
    if isinstance(model.patch_embed, HybridEmbed):
        rules += _hybrid_backbone_rules(model.patch_embed.backbone, "patch_embed.backbone.")
    return rules


def _hybrid_backbone_rules(backbone: ResNetV2, t: str) -> list[_Rule]:
    """Official vision_transformer hybrid names: conv_root, gn_root, block{i}/unit{j}/{conv,gn}{r}."""
    rules = [_conv(f"{t}stem.conv.weight", "conv_root/kernel"),
             _vector(f"{t}stem.norm.weight", "gn_root/scale"), _vector(f"{t}stem.norm.bias", "gn_root/bias")]
    for i, stage in enumerate(cast("list[ResNetStage]", list(backbone.stages))):
        for j, blk in enumerate(stage.blocks):
            b, p = f"{t}stages.{i}.blocks.{j}.", f"block{i + 1}/unit{j + 1}/"
            for r in (1, 2, 3):
                rules += [_conv(f"{b}conv{r}.weight", f"{p}conv{r}/kernel"),
                          _vector(f"{b}norm{r}.weight", f"{p}gn{r}/scale"),
                          _vector(f"{b}norm{r}.bias", f"{p}gn{r}/bias")]
            if blk.downsample is not None:
                rules += [_conv(f"{b}downsample.conv.weight", f"{p}conv_proj/kernel"),
                          _vector(f"{b}downsample.norm.weight", f"{p}gn_proj/scale"),
                          _vector(f"{b}downsample.norm.bias", f"{p}gn_proj/bias")]
    return rules


def _bit_rules(model: ResNetV2) -> list[_Rule]:
    """BiT npz names (big_transfer): resnet/root_block, resnet/block{i}/unit{jj}/{a,b,c}/..."""
    if not model.cfg.dims.preact:
        return _hybrid_backbone_rules(model, "")
    p0, conv = "resnet/", "standardized_conv2d/kernel"
    rules = [_conv("stem.conv.weight", f"{p0}root_block/{conv}"),
             _vector("norm.weight", f"{p0}group_norm/gamma"), _vector("norm.bias", f"{p0}group_norm/beta")]
    for i, stage in enumerate(cast("list[ResNetStage]", list(model.stages))):
        for j, blk in enumerate(stage.blocks):
            b, p = f"stages.{i}.blocks.{j}.", f"{p0}block{i + 1}/unit{j + 1:02d}/"
            for r, u in zip((1, 2, 3), "abc"):
                rules += [_conv(f"{b}conv{r}.weight", f"{p}{u}/{conv}"),
                          _vector(f"{b}norm{r}.weight", f"{p}{u}/group_norm/gamma"),
                          _vector(f"{b}norm{r}.bias", f"{p}{u}/group_norm/beta")]
            if blk.downsample is not None:
                rules.append(_conv(f"{b}downsample.conv.weight", f"{p}a/proj/{conv}"))
    rules += [_Rule("head.weight", (f"{p0}head/conv2d/kernel",), lambda a: a[0].reshape(a[0].shape[-2:]).T,
                    lambda w: [w.T[None, None]]),
              _same("head.bias", f"{p0}head/conv2d/bias")]
    return rules


def rules_for(model: nn.Module) -> list[_Rule]:
    if isinstance(model, VisionTransformer):
        return _vit_rules(model)
    if isinstance(model, ResNetV2):
        return _bit_rules(model)
    raise ValueError(f"no checkpoint layout for {type(model).__name__}; expected a vitscale model")


def weights_array(key: str, value: np.ndarray) -> np.ndarray:
    """An npz entry as float weights. JAX writes bfloat16 as a 2-byte void (numpy has no bfloat16): widened to
    float32 exactly. Anything else not a float (text, integers, objects) is no weight: a ValueError naming it,
    where torch refused it with a TypeError (a traceback) or an integer was cast into the model silently."""
    value = np.asarray(value)
    if value.dtype.kind == "V" and value.dtype.itemsize == 2 and value.dtype.fields is None:
        return (value.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if value.dtype.kind != "f":
        raise ValueError(f"npz entry {key!r} holds {value.dtype} values, not floating-point weights")
    return value


_BIG_VISION_BLOCK = {"MultiHeadDotProductAttention_0/": "MultiHeadDotProductAttention_1/",
                     "LayerNorm_1/": "LayerNorm_2/", "MlpBlock_0/": "MlpBlock_3/"}
"""big_vision's encoder-block module names -> the vision_transformer repo's (the names the rules use)."""


def official_npz_names(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A training checkpoint's weights under the official names: the vision_transformer repo's (``opt/target/``
    beside the optimizer's state) and big_vision's (``params/``; blocks named ``..._0``, layers stacked under
    ``encoderblock`` when scanned, ``pos_embedding`` one row per patch: timm's no_embed_class). Once every entry
    was "unexpected" and every parameter "missing"."""
    for prefix in ("opt/target/", "params/img/", "params/"):
        if any(k.startswith(f"{prefix}embedding/") for k in arrays):
            arrays = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
            break
    if not any("/MultiHeadDotProductAttention_0/" in k for k in arrays):
        return dict(arrays)
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        if key.startswith("Transformer/encoderblock/"):  # scanned: the layers stacked on the first axis
            rest = key.removeprefix("Transformer/encoderblock/")
            out.update({f"Transformer/encoderblock_{i}/{rest}": value[i] for i in range(len(value))})
        else:
            out["Transformer/posembed_input/pos_embedding" if key == "pos_embedding" else key] = value
    for old, new in _BIG_VISION_BLOCK.items():
        out = {(k.replace(f"/{old}", f"/{new}") if k.startswith("Transformer/encoderblock_") else k): v
               for k, v in out.items()}
    return out


def npz_to_state_dict(arrays: Mapping[str, np.ndarray], model: nn.Module) -> tuple[dict[str, Tensor], list[str]]:
    """Convert npz arrays by the model's rules; returns (state dict, unexpected npz keys)."""
    arrays = {k.removeprefix("ResNet/"): v for k, v in official_npz_names(arrays).items()}
    used: set[str] = set()
    out: dict[str, Tensor] = {}
    for rule in rules_for(model):
        if not all(k in arrays for k in rule.keys):
            continue
        used.update(rule.keys)
        try:
            value = rule.to_torch([weights_array(k, arrays[k]) for k in rule.keys])
        except ValueError as exc:  # reshape failed: the file's dims differ from the model's
            raise ValueError(f"npz entries {list(rule.keys)} do not fit {rule.name}: {exc}") from exc
        out[rule.name] = torch.from_numpy(np.ascontiguousarray(value))
    for key, value in arrays.items():
        if key.startswith(EXTRA_PREFIX):
            used.add(key)
            out[key[len(EXTRA_PREFIX):]] = torch.from_numpy(np.ascontiguousarray(weights_array(key, value)))
    return out, sorted(set(arrays) - used)


def npz_arrays(model: nn.Module, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`weights` (the model's state dict as arrays) under the official names, by the model's rules; the rest
    as ``vitscale/<name>``."""
    weights = dict(weights)
    arrays: dict[str, np.ndarray] = {}
    for rule in rules_for(model):
        if rule.name in weights:
            for key, value in zip(rule.keys, rule.to_npz(weights.pop(rule.name))):
                arrays[key] = np.ascontiguousarray(value)
    for name, value in weights.items():
        arrays[EXTRA_PREFIX + name] = value
    return arrays
