"""Where things live: the one test for "is this a URL", the one spelling of a storage location, and
the one rule for where a run and its node-local cache are.

Every location in a pipeline (a dataset, `cluster.storage_path`, a checkpoint) is either a local
path or a URL with a scheme (`s3://bucket/prefix`, `file:///...`). Code that must tell them apart
asks `is_url`; code that needs a run's place asks `run_location` (or `ClusterConfig.run_storage`),
which is always in the one canonical form `canonical_location` gives: the lease, the run's mirror
and Ray Train all receive that same string, so two spellings of one place can never hold two
leases on it while writing into one folder.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from vitscale.config.checks import AMBIGUOUS_CHARS, ConfigError, is_control

STORAGE_KEY = "cluster.storage_path"
"""The key named when a run's storage location is refused."""

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket name characters: 3-63 lower-case letters, digits, '.' and '-', a letter or digit at each end
(lower case: S3 itself refuses upper-case names for new buckets). `bucket_problem` adds the other rules."""

_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
"""Names AWS reserves for access-point aliases, directory buckets, Multi-Region access points, table
buckets and its own examples (docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html)."""

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
"""What a URL's scheme looks like (RFC 3986): a location whose first segment starts so is a URL
(`s3:/bar`, `s3:bar`, `file:/x`), never a relative local folder named `s3:`."""

def is_url(location: str) -> bool:
    """Whether `location` is a URL with a scheme (`s3://...`, `file://...`), not a local path."""
    return "://" in location


def bucket_problem(bucket: str) -> str | None:
    """Why S3 refuses ``bucket`` as a bucket name (AWS's general-purpose naming rules), or None."""
    if not _BUCKET.fullmatch(bucket):
        return "3-63 lower-case letters, digits, '.' and '-', beginning and ending with a letter or digit"
    if ".." in bucket or ".-" in bucket or "-." in bucket:
        return "no two adjacent periods, and no period beside a hyphen"
    if _IP_ADDRESS.fullmatch(bucket):
        return "not formatted as an IP address"
    reserved = [p for p in _RESERVED_PREFIXES if bucket.startswith(p)] + \
        [s for s in _RESERVED_SUFFIXES if bucket.endswith(s)]
    if reserved:
        return f"{reserved[0]!r} is reserved by AWS"
    return None


def canonical_location(location: str, key: str = STORAGE_KEY) -> str:
    """The one spelling of a storage location; `ConfigError(key, ...)` in one line for one that has none.

    - `s3://bucket/a/b`: scheme lower-cased, `.` and empty segments (`//`, a trailing `/`) dropped,
      `..` applied (refused if it climbs out of the bucket);
    - `file:///path` and local paths: `~` expanded and the path made absolute with symlinks and `..`
      resolved (`file://` dropped: a local path is what the lease, the mirror and Ray all take);
    - `file:/path` (RFC 8089's short form of `file:///path`): the same local path;
    - refused: other schemes, a bucket that breaks S3's naming rules (`bucket_problem`), `%`, `?`, `#`,
      `\\`, control characters (see `checks.AMBIGUOUS_CHARS`), `file://HOST/...`, and anything else whose first
      segment looks like a scheme (`s3:/bar`, `s3:bar`, `file:x`): a URL spelled wrong, never taken for
      a relative folder named `s3:`.

    Idempotent: a canonical location is its own canonical form.
    """
    if not location:
        raise ConfigError(key, "must name a folder or an s3:// prefix")
    if any(is_control(c) for c in location):
        raise ConfigError(key, f"{location!r} contains a control character")
    if not is_url(location):
        if _SCHEME.match(location) is None:
            return _canonical_path(location)
        return _short_url(location, key)
    scheme, _, rest = location.partition("://")
    scheme = scheme.lower()
    _refuse_ambiguous(location, key)
    if scheme == "file":
        if not rest.startswith("/"):
            raise ConfigError(key, f"{location}: a file:// URL names a local path (file:///path), not a host")
        return _canonical_path(rest)
    if scheme != "s3":
        raise ConfigError(key, f"{location}: use a local path, file:// or s3://")
    return _canonical_s3(rest, location, key)


def _short_url(location: str, key: str) -> str:
    """A location that starts with a scheme but has no `//`: RFC 8089's `file:/path`, or refused."""
    scheme, _, rest = location.partition(":")
    _refuse_ambiguous(location, key)
    if scheme.lower() == "file" and rest.startswith("/"):
        return _canonical_path(rest)
    if scheme.lower() == "s3":
        return _malformed(location, key, "an S3 location is written s3://bucket/prefix")
    if scheme.lower() == "file":
        return _malformed(location, key, "a file URL names an absolute path (file:///path or file:/path)")
    return _malformed(location, key, f"{scheme + ':'!r} reads as a URL scheme; use a local path "
                      "(./" + location + " for a folder of that name), file:// or s3://")


def _malformed(location: str, key: str, why: str) -> str:
    raise ConfigError(key, f"{location} is not a location vitscale reads: {why}")


def _refuse_ambiguous(location: str, key: str) -> None:
    for char, what in AMBIGUOUS_CHARS.items():
        if char in location:
            raise ConfigError(key, f"{location} contains {what}, which tools read differently; "
                              "write the location with plain characters")


def _canonical_path(path: str) -> str:
    return str(Path(os.path.expanduser(path)).resolve())


def _canonical_s3(rest: str, location: str, key: str) -> str:
    bucket, _, prefix = rest.partition("/")
    problem = bucket_problem(bucket)
    if problem is not None:
        raise ConfigError(key, f"{location}: {bucket!r} is not an S3 bucket name ({problem})")
    parts: list[str] = []
    for part in prefix.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise ConfigError(key, f"{location}: '..' climbs out of the bucket {bucket}")
            parts.pop()
            continue
        parts.append(part)
    return "/".join([f"s3://{bucket}", *parts])


def run_location(storage_path: str, run_name: str) -> str:
    """Where the run `run_name` keeps its checkpoints and results: `storage_path/run_name`, canonical."""
    return f"{canonical_location(storage_path)}/{run_name}"


FINETUNE_PART = "finetune"
"""Where a pipeline's fine-tuning stage stores its Train run inside the run (`storage_path/run/finetune`).
Before, it was a sibling, `storage_path/run-finetune`: readers still find that (`train/export.py`), and
the finetune stage refuses to resume one in one line naming the new place."""

SIBLING_FINETUNE_SUFFIX = "-finetune"
"""The older layout's sibling fine-tuning run: `<run>-finetune` beside `<run>`."""


def part_location(run_storage: str, part: str) -> str:
    """Where a part of a run (`finetune`, `sweep/trials/<id>`) is stored: inside the run, never beside it."""
    return posixpath.join(run_storage, part) if part else run_storage


def endpoint_ok(url: str) -> bool:
    """An S3 endpoint boto3 can take: http(s), a host, a numeric port if any, no white space (boto3 refuses
    the rest only at the first read, in a line that names no setting)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)


def canonical_endpoint(endpoint_url: str | None) -> str:
    """An endpoint URL with its case-insensitive parts (scheme, host) lower-cased and no trailing `/`."""
    if not endpoint_url:
        return ""  # AWS's own endpoint
    parts = urlsplit(endpoint_url.strip())
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), parts.query, ""))


def run_cache_name(run_storage: str, endpoint_url: str | None) -> str:
    """The name of a run's node-local cache folder: the run's name, readable, and a hash of where it is.

    Keyed by the run's whole canonical location and the object-storage endpoint, never by its name
    alone: `s3://team-a/runs/exp1` and `s3://team-b/runs/exp1` (or one bucket name on two endpoints)
    are different runs, and a shared folder would push one run's files into the other's storage.
    """
    endpoint = canonical_endpoint(endpoint_url)
    digest = hashlib.sha256(f"{run_storage}\n{endpoint}".encode()).hexdigest()[:12]
    name = posixpath.basename(run_storage.rstrip("/"))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"
    return f"{slug[:64]}-{digest}"
