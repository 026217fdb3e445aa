"""Hugging Face transformers' ViT state dicts (``ViTModel``, ``ViTForImageClassification``), renamed to timm's.

The paper's checkpoints are also published in this layout (``google/vit-base-patch16-224-in21k`` and the rest):
``pytorch_model.bin`` or ``model.safetensors`` beside a ``config.json``. The architecture is the paper's, as
timm's and vitscale's: pre-norm blocks, exact GELU, a class token, a tanh pre-logits layer (transformers'
"pooler") where the checkpoint has one. Only the names differ, and attention's query, key and value are three
matrices where timm holds them stacked in one (``qkv``, in that order):

| transformers (after an optional ``vit.``) | timm / vitscale |
|---|---|
| ``embeddings.cls_token``, ``embeddings.position_embeddings`` | ``cls_token``, ``pos_embed`` |
| ``embeddings.patch_embeddings.projection`` | ``patch_embed.proj`` |
| ``encoder.layer.{i}.layernorm_before``, ``.layernorm_after`` | ``blocks.{i}.norm1``, ``.norm2`` |
| ``encoder.layer.{i}.attention.attention.{query,key,value}`` | ``blocks.{i}.attn.qkv`` (stacked) |
| ``encoder.layer.{i}.attention.output.dense`` | ``blocks.{i}.attn.proj`` |
| ``encoder.layer.{i}.intermediate.dense``, ``.output.dense`` | ``blocks.{i}.mlp.fc1``, ``.mlp.fc2`` |
| ``layernorm``, ``pooler.dense``, ``classifier`` | ``norm``, ``pre_logits.fc``, ``head`` |

Not the same: transformers' layer norms add 1e-12 to the variance, vitscale's (timm's) 1e-6: the logits of
`tests/test_weights_files.py`'s small ViT move by 5e-6, against transformers' forward written out there.
Anything else in the file keeps its name, and the loader refuses it as a parameter the model does not have.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["LAYER_NORM_NOTE", "from_transformers", "is_transformers_vit"]

_MARK = "embeddings.patch_embeddings.projection.weight"
_RENAMES = (
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.position_embeddings", "pos_embed"),
    (r"embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"encoder\.layer\.(\d+)\.layernorm_before\.", r"blocks.\1.norm1."),
    (r"encoder\.layer\.(\d+)\.layernorm_after\.", r"blocks.\1.norm2."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attn.proj."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.mlp.fc1."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.mlp.fc2."),
    (r"layernorm\.", "norm."),
    (r"pooler\.dense\.", "pre_logits.fc."),
    (r"classifier\.", "head."),
)
_QKV = re.compile(r"encoder\.layer\.(\d+)\.attention\.attention\.(query|key|value)\.(weight|bias)")
LAYER_NORM_NOTE = ("a Hugging Face transformers ViT: its layer norms run with vitscale's epsilon, 1e-6 "
                   "(transformers': 1e-12)")
"""What the load report says of such a file."""


def is_transformers_vit(sd: Mapping[str, object]) -> bool:
    """Whether a state dict is a transformers ViT's (its patch projection under transformers' name)."""
    return any(k.removeprefix("vit.") == _MARK for k in sd)


def from_transformers(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A transformers ViT state dict under timm's names (module doc); a block whose query, key and value are
    not all there keeps them under their own names (refused by the loader as parameters the model lacks)."""
    out: dict[str, Tensor] = {}
    stacks: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, value in sd.items():
        name = key.removeprefix("vit.")
        if found := _QKV.fullmatch(name):
            block, which, kind = found.groups()
            stacks.setdefault((block, kind), {})[which] = value
            continue
        for pattern, replacement in _RENAMES:
            renamed, n = re.subn(f"^{pattern}", replacement, name)
            if n:
                name = renamed
                break
        out[name] = value
    for (block, kind), parts in stacks.items():
        if set(parts) == {"query", "key", "value"}:
            out[f"blocks.{block}.attn.qkv.{kind}"] = torch.cat([parts["query"], parts["key"], parts["value"]])
        else:
            for which, value in parts.items():
                out[f"encoder.layer.{block}.attention.attention.{which}.{kind}"] = value
    return out
