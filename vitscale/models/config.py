"""The `model` section: a model named once, with the model's own keyword arguments.

    model:
      name: ViT-B/16         # `vitscale models` lists every name
      img_size: 224
      dropout: 0.1           # any option of `create_model` (models/options.py), nothing else
                             # (null = the model's default)

As in big_vision, the section *is* the model's keyword arguments: no field here mirrors a model
option, so an option added to the model is usable in a pipeline without touching this file.
`validate()` asks `create_model` itself (on the meta device: instant, no memory) and turns its
complaint into an error naming `model.<option>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vitscale.config.checks import ConfigError, check, positive_int


@dataclass(frozen=True)
class ModelConfig:
    name: str = "ViT-B/16"
    """Model name as in the paper: "ViT-B/16", "R50x1", "R50x1+ViT-B/16"."""
    img_size: int = 224
    """Input resolution in pixels (square)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Every other key of the section: keyword arguments of `create_model` (models/options.py)."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], key: str = "model") -> ModelConfig:
        """Parse a `model:` section: `name`, `img_size`, and the rest as the model's options."""
        raw = dict(raw)
        name = raw.pop("name", cls.name)
        img_size = raw.pop("img_size", cls.img_size)
        check(isinstance(name, str), f"{key}.name", f"must be a model name, got {name!r}")
        check(isinstance(img_size, int) and not isinstance(img_size, bool), f"{key}.img_size",
              f"expected an integer, got {img_size!r}")
        # null means "the model's default" for every option (as for dims, "the table's value"):
        # a ResNet recipe that extends a ViT pipeline clears the ViT-only options with null.
        raw = {k: v for k, v in raw.items() if v is not None}
        if isinstance(raw.get("resnet_layers"), list):
            raw["resnet_layers"] = tuple(raw["resnet_layers"])  # YAML lists; the model takes a tuple
        return cls(name=name, img_size=img_size, options=raw)

    def to_mapping(self) -> dict[str, Any]:
        """The section as written in YAML (what `vitscale config` prints and run directories keep)."""
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()}
        return {"name": self.name, "img_size": self.img_size, **options}

    def validate(self, key: str = "model") -> None:
        """Build the model on the meta device: the model's own checks, errors naming `model.<option>`."""
        import torch

        from vitscale.models.factory import create_model

        positive_int(self.img_size, f"{key}.img_size")
        try:
            with torch.device("meta"):
                create_model(self.name, num_classes=1, img_size=self.img_size, **self.options)
        except ConfigError as exc:
            raise ConfigError(f"{key}.{exc.key}", exc.message) from None
        except ValueError as exc:
            # An unknown name (with close matches) or a size the patch grid cannot take.
            field_name = "name" if "model name" in str(exc) else "img_size" if "img_size" in str(exc) else ""
            raise ConfigError(f"{key}.{field_name}" if field_name else key, str(exc)) from None
        except (RuntimeError, TypeError, OverflowError) as exc:
            # Sizes whose tensors no 64-bit size can hold (`img_size: 2147483648`, `width: 1099511627776`): torch
            # refuses them even on the meta device.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(key, f"{self.name} cannot be built at img_size {self.img_size} with "
                                   f"{dict(self.options) or 'its default options'}: {first}") from None

    def build(self, num_classes: int) -> Any:
        """The model (an `nn.Module`) with a zero-initialised head of `num_classes` outputs."""
        from vitscale.models.factory import create_model

        return create_model(self.name, num_classes=num_classes, img_size=self.img_size, **self.options)

    def __hash__(self) -> int:  # options is a dict; the config is still a value
        return hash((self.name, self.img_size, tuple(sorted(self.options.items(), key=lambda kv: kv[0]))))
