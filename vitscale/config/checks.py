"""The one set of value checks every layer uses, and the error they raise.

Config dataclasses call these in their `validate()` with the dotted YAML key (`train.base_lr`);
library functions that take user-supplied arguments (`create_model`, `forward_flops`, the loader)
call them with the argument's name. Either way the error names the key, so a user can act on it.
Numbers must also be finite: `nan` and `inf` are never a sensible learning rate, size or count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any


class ConfigError(ValueError):
    """A value a user must fix; the message names the dotted key (and the file when known)."""

    def __init__(self, key: str, message: str, source: str | None = None, also: tuple[str, ...] = ()):
        self.key = key
        self.message = message
        self.source = source
        self.also = also
        """Other keys whose values together with `key`'s break the rule (a sum of two shares): a `--set` of
        any of them is named as the source."""
        where = f" (in {source})" if source else ""
        super().__init__(f"{key}: {message}{where}")

    def in_file(self, source: str) -> ConfigError:
        """The same error, naming the file it came from (unless it already names one)."""
        return self if self.source else ConfigError(self.key, self.message, source, self.also)


def check(ok: bool, key: str, message: str) -> None:
    """Raise `ConfigError(key, message)` unless `ok`."""
    if not ok:
        raise ConfigError(key, message)


def _number(value: Any, key: str) -> float:
    check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
          f"must be a number, got {value!r}")
    check(math.isfinite(value), key, f"must be finite, got {value!r}")
    return float(value)


def positive(value: float | None, key: str) -> None:
    """A finite number > 0 (None passes: "not set")."""
    if value is not None:
        check(_number(value, key) > 0, key, f"must be > 0, got {value!r}")


def non_negative(value: float | None, key: str) -> None:
    """A finite number >= 0 (None passes: "not set")."""
    if value is not None:
        check(_number(value, key) >= 0, key, f"must be >= 0, got {value!r}")


def finite(value: float | None, key: str) -> None:
    """Any finite number (None passes)."""
    if value is not None:
        _number(value, key)


def probability(value: float, key: str) -> None:
    """A rate in [0, 1): dropout, label smoothing, Adam betas."""
    check(0.0 <= _number(value, key) < 1.0, key, f"must be in [0, 1), got {value!r}")


def fraction(value: float, key: str) -> None:
    """A fraction in [0, 1], both ends allowed."""
    check(0.0 <= _number(value, key) <= 1.0, key, f"must be in [0, 1], got {value!r}")


def one_of(value: Any, choices: Collection[Any], key: str) -> None:
    """One of a fixed set of choices."""
    check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


MAX_RESOLUTION = 4096
"""The largest input side, in pixels, of any model or stream (`model.img_size`, `finetune.resolution`,
`fewshot.resolution`, a loader's output, `flops --resolution`): eight times the paper's largest (512 px). A ViT-B/16
at 4,096 px already has 65,536 tokens; `img_size: 100000` passed the meta-device build and only failed when a
worker ran out of memory allocating its position embeddings."""


def image_side(value: Any, key: str) -> int:
    """An input side in pixels, in [1, MAX_RESOLUTION]; returns it."""
    positive_int(value, key)
    check(value <= MAX_RESOLUTION, key, f"must be at most {MAX_RESOLUTION} px, got {value}")
    return value


def positive_int(value: Any, key: str) -> int:
    """An int >= 1 (not a bool, not a float); returns it. For arguments of library functions."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
          f"must be a positive int, got {value!r}")
    return value


AMBIGUOUS_CHARS = {"%": "a %-encoding", "?": "a query (?)", "#": "a fragment (#)", "\\": "a backslash"}
"""Characters one tool reads literally and another decodes or splits on in a storage URL (pyarrow's URI parser,
which Ray Train's storage uses, decodes `%2F` and reads `?` as options; boto3 takes the key as written):
refused in a location (`config/location.py`) and in a name that becomes part of one (`plain_name`)."""


def is_control(char: str) -> bool:
    """A control character (C0 or DEL): nothing a name or a location may hold."""
    return ord(char) < 32 or ord(char) == 127


NAME_MAX_BYTES = 200
"""The longest a name may be where it becomes one file or folder name (a run's folder, a split's shard files),
in UTF-8 bytes: file systems take 255 a name, and vitscale adds up to 30 to it (`-finetune`, `-000000.tar`, an
atomic write's `.NAME.<12 hex digits>.part`)."""


def name_bytes(value: str) -> int:
    """The length of `value` as a file system counts a name: its UTF-8 bytes."""
    return len(value.encode("utf-8", "surrogatepass"))


def name_length(value: str, key: str) -> None:
    """`value`, a name that becomes a file or folder name, is at most `NAME_MAX_BYTES` long."""
    size = name_bytes(value)
    check(size <= NAME_MAX_BYTES, key, f"is {size} bytes long: a name may be at most {NAME_MAX_BYTES} (it names a "
                                       "folder or files, and file systems take 255 bytes a name)")


def plain_name(value: Any, key: str) -> str:
    """A name that becomes one path component, of a local folder or of an s3:// location (a run's name, a
    split's): no separators, not '.' or '..', not empty, none of `AMBIGUOUS_CHARS`, no control character. A run
    named `exp?x` on s3:// was a location pyarrow refuses (`Unexpected query parameter`) and boto3 writes to."""
    check(isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value
          and "\0" not in value, key, f"must be a plain name (no '/', '\\', '..'), got {value!r}")
    ambiguous = next((what for char, what in AMBIGUOUS_CHARS.items() if char in value), None)
    check(ambiguous is None, key, f"{value!r} contains {ambiguous}, which tools read differently in a storage "
                                  "location; use plain characters")
    check(not any(is_control(c) for c in value), key, f"{value!r} contains a control character")
    name_length(value, key)
    return value


SEED_LIMIT = 2**32
"""Seeds are below 2**32: NumPy's legacy seeding takes no more, and torch's takes a 64-bit int."""


def seed(value: Any, key: str, count: int = 1) -> int:
    """A seed (or the first of `count` consecutive seeds): an int in [0, 2**32 - count]."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value + count <= SEED_LIMIT,
          key, f"must be an int in [0, {SEED_LIMIT - count}], got {value!r}")
    return value


def non_negative_int(value: Any, key: str) -> int:
    """An int >= 0 (not a bool: `warmup_steps: true` is a typo, not 1); returns it."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, key,
          f"must be an int >= 0, got {value!r}")
    return value


def number(value: Any, key: str) -> float:
    """Any finite int or float (not a bool); returns it as a float."""
    return _number(value, key)


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
"""One label of a host name (RFC 1123): ASCII letters, digits and inner hyphens, 1 to 63 of them."""


def check_address(value: Any, key: str) -> str:
    """An IPv4/IPv6 address or host name a server can bind ("127.0.0.1", "0.0.0.0", "::", "localhost")."""
    import ipaddress

    check(isinstance(value, str) and value != "", key, f"must be an address to bind, got {value!r}")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        # The last label not all digits, so that a number YAML turned into text ("0", "2147483648") or a short
        # form ("10.1") is not bound as the address the C library's inet_aton makes of it.
        labels = value.split(".")
        check(len(value) < 254 and all(_HOST_LABEL.fullmatch(part) for part in labels) and not labels[-1].isdigit(),
              key, f"must be an IP address or host name, got {value!r}")
    return value
