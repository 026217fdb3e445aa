"""Retrying object-store calls: which errors are worth another try, for how long, and the one loop.

Every failed object-store call is sorted here (:func:`classify`), whoever made it (boto3 for datasets,
leases and run files; pyarrow's S3 filesystem for checkpoints, whose errors arrive as text):

- **missing**: the object is not there (``NoSuchKey``, a 404 without a body): ``FileNotFoundError``;
- **permanent**, errors that will not heal by waiting (``AccessDenied``, ``InvalidAccessKeyId``,
  ``SignatureDoesNotMatch``, ``NoSuchBucket``, any other 4xx; an endpoint whose name does not resolve
  or that refuses connections): the call stops at once;
- **transient**, errors that may heal (HTTP 5xx, throttling such as 503 ``SlowDown``, dropped or reset
  connections, timeouts, bodies cut short): retried with exponential backoff and full jitter until
  the retry budget is spent.

The retry budget is the one setting of this module: ``$VITSCALE_S3_RETRY_S`` seconds (default
:data:`DEFAULT_RETRY_S`), read and checked by :func:`retry_budget_s`. No new try starts after it
has passed since a call's first try; the last error then ends the call in one line naming the
object, the error and the tries (:func:`call`).

Either way the error that ends a call is *final* (``StorageError.final``, :func:`final_reason`): a
refusal does not heal, and the budget has already waited for the rest, so trying again at once (a
restart of the run's workers) would only repeat it: a run stops on it (``launch/failures.py``).
"""

from __future__ import annotations

import enum
import http.client
import logging
import math
import os
import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

from vitscale.config.checks import non_negative, positive_int
from vitscale.config.errors import UserError
from vitscale.data.storage.base import StorageError

__all__ = [
    "DEFAULT_RETRY_S",
    "RETRY_ENV",
    "Failure",
    "RetryPolicy",
    "ShortRead",
    "call",
    "classify",
    "describe",
    "final_reason",
    "is_missing",
    "is_transient",
    "retry_budget_s",
    "sdk_attempts",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_ENV = "VITSCALE_S3_RETRY_S"
"""The environment variable holding the retry budget in seconds (handed to every Ray worker)."""
DEFAULT_RETRY_S = 60.0
"""Seconds a call keeps retrying a transient error: long enough for S3 throttling to pass, short
enough that a store that stays broken ends a command or a run within about a minute."""

# S3 error codes that mean "try again later" even when the HTTP status is not 5xx.
_TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
    }
)
# A missing bucket is not a missing object: writing into it cannot work, and "no such object" would
# send the user looking for the wrong thing.
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})

# pyarrow's S3 errors carry the AWS SDK's error name as text: "AWS Error SLOW_DOWN during PutObject
# operation: ...", and for network failures the curl code ("curlCode: 6, Couldn't resolve host name").
_SDK_ERROR = re.compile(r"AWS Error ([A-Z_]+)")
_SDK_TRANSIENT = frozenset({"SLOW_DOWN", "THROTTLING", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE",
                            "REQUEST_TIMEOUT", "REQUEST_TIME_TOO_SKEWED", "NETWORK_CONNECTION", "UNKNOWN"})
_SDK_MISSING = frozenset({"NO_SUCH_KEY", "RESOURCE_NOT_FOUND"})
_CURL_UNREACHABLE = re.compile(r"curlCode: (6|7),")  # 6: name does not resolve, 7: connection refused
_HTTP_STATUS = re.compile(r"HTTP (?:response )?(?:code|status)[: ]+(\d{3})", re.IGNORECASE)


class Failure(enum.Enum):
    """What a failed call means for the next try."""

    MISSING = "missing"
    PERMANENT = "permanent"
    TRANSIENT = "transient"


@lru_cache(maxsize=8)
def _parse_budget(text: str | None) -> float:
    if text is None or not text.strip():
        return DEFAULT_RETRY_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UserError(f"${RETRY_ENV}: must be a number of seconds >= 0 (how long object-storage calls retry "
                        f"errors that may heal; default {DEFAULT_RETRY_S:g}), got {text!r}")
    return value


def retry_budget_s() -> float:
    """The retry budget in seconds: ``$VITSCALE_S3_RETRY_S``, else :data:`DEFAULT_RETRY_S`.

    The one check of the setting: anything but a finite number >= 0 is a ``UserError`` naming the
    variable. 0 means one try, no retry.
    """
    return _parse_budget(os.environ.get(RETRY_ENV))


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter for transient object-store errors."""

    max_attempts: int | None = None
    """Most tries per call, the first one included; None: as many as ``budget_s`` allows."""
    base_delay_s: float = 0.05
    """Upper bound of the first backoff; doubles per attempt (full jitter draws in [0, bound])."""
    max_delay_s: float = 5.0
    """Cap on any single backoff."""
    budget_s: float = DEFAULT_RETRY_S
    """No new try starts once this many seconds have passed since the call's first try."""

    def __post_init__(self) -> None:
        if self.max_attempts is not None:
            positive_int(self.max_attempts, "RetryPolicy.max_attempts")
        non_negative(self.base_delay_s, "RetryPolicy.base_delay_s")
        non_negative(self.max_delay_s, "RetryPolicy.max_delay_s")
        non_negative(self.budget_s, "RetryPolicy.budget_s")

    @classmethod
    def from_setting(cls) -> RetryPolicy:
        """The default policy with the budget of ``$VITSCALE_S3_RETRY_S``."""
        return cls(budget_s=retry_budget_s())

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based), budget aside."""
        bound = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return (rng or random).uniform(0.0, bound)

    def next_delay(self, attempt: int, elapsed_s: float) -> float | None:
        """Seconds to sleep before try ``attempt + 1``, or None when the tries or the budget are spent.

        The sleep never runs past the budget, so the last try starts by ``budget_s`` at the latest.
        """
        if (self.max_attempts is not None and attempt >= self.max_attempts) or elapsed_s >= self.budget_s:
            return None
        return min(self.delay(attempt), self.budget_s - elapsed_s)


class ShortRead(Exception):
    """A body ended before the length the server announced (a dropped connection in disguise)."""


def _wrapped(exc: BaseException) -> BaseException | None:
    """The error a wrapper such as boto3's ``S3UploadFailedError`` (managed uploads) stands for."""
    from boto3.exceptions import S3UploadFailedError

    if isinstance(exc, S3UploadFailedError):
        return exc.__cause__ or exc.__context__
    return None


def classify(exc: BaseException) -> Failure:
    """Whether ``exc`` means the object is missing, the call will never work, or it may on a retry."""
    inner = _wrapped(exc)
    if inner is not None:
        return classify(inner)
    import botocore.exceptions as bce

    if isinstance(exc, bce.ClientError):
        return _classify_answer(exc)
    if isinstance(exc, (bce.EndpointConnectionError, ConnectionRefusedError, socket.gaierror)):
        # No TCP connection at all: a name that does not resolve or a port nobody listens on.
        # (botocore's ConnectTimeoutError, a connect that timed out, is a sibling class: transient.)
        return Failure.PERMANENT
    if isinstance(exc, _transient_types()):
        return Failure.TRANSIENT
    if isinstance(exc, OSError) and _SDK_ERROR.search(str(exc)):
        return _classify_sdk_text(str(exc))
    # Without a chained cause a managed upload's failure is mostly the network's (tries stay bounded).
    from boto3.exceptions import S3UploadFailedError

    return Failure.TRANSIENT if isinstance(exc, S3UploadFailedError) else Failure.PERMANENT


def _transient_types() -> tuple[type[BaseException], ...]:
    import botocore.exceptions as bce
    import urllib3.exceptions as u3e

    return (
        bce.ConnectionError,  # connect timeout, proxy, SSL (an unreachable endpoint is handled above)
        bce.HTTPClientError,  # connection closed, read timeout, response streaming error
        bce.IncompleteReadError,
        u3e.HTTPError,  # protocol errors while streaming a body
        http.client.IncompleteRead,
        http.client.RemoteDisconnected,
        ConnectionError,  # builtin: reset/aborted (refused is handled above)
        TimeoutError,
        ShortRead,
    )


def _classify_answer(exc: BaseException) -> Failure:
    """An answer from the server (boto3's ``ClientError``): by its HTTP status and S3 error code."""
    response = getattr(exc, "response", {})
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    if code in _TRANSIENT_CODES or status >= 500 or status == 429 or code.startswith("5"):
        return Failure.TRANSIENT
    if code in _MISSING_CODES or (status == 404 and code != "NoSuchBucket"):
        return Failure.MISSING
    return Failure.PERMANENT


def _classify_sdk_text(text: str) -> Failure:
    """A pyarrow (AWS SDK for C++) error, by the SDK's error name in its text."""
    match = _SDK_ERROR.search(text)
    name = match.group(1) if match else ""
    if name == "NETWORK_CONNECTION" and _CURL_UNREACHABLE.search(text):
        return Failure.PERMANENT
    if name in _SDK_TRANSIENT:
        status = _HTTP_STATUS.search(text)
        if name == "UNKNOWN" and status is not None and int(status.group(1)) < 500 and status.group(1) != "429":
            return Failure.PERMANENT
        return Failure.TRANSIENT
    return Failure.MISSING if name in _SDK_MISSING else Failure.PERMANENT


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying (:func:`classify`)."""
    return classify(exc) is Failure.TRANSIENT


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the object does not exist (:func:`classify`)."""
    return classify(exc) is Failure.MISSING


def describe(exc: BaseException) -> str:
    """The error in a few words for a one-line message: ``SlowDown (HTTP 503): Please reduce ...``."""
    inner = _wrapped(exc)
    if inner is not None:
        return describe(inner)
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        err = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = err.get("Code") or "error"
        text = f"{code} (HTTP {status})" if status else str(code)
        return f"{text}: {err['Message']}" if err.get("Message") else text
    if isinstance(exc, RecursionError):
        # botocore follows an S3 redirect (301/307) by asking again; a server that is no S3 (a web server
        # redirecting `/bucket` to `/bucket/`) sends it round until Python's stack ends.
        return "the endpoint answered with redirects without end, as no S3 server does: is it an S3 endpoint?"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, OSError) and _SDK_ERROR.search(text) else f"{type(exc).__name__}: {text}"


def call(fn: Callable[[], T], policy: RetryPolicy, what: str, where: str) -> T:
    """``fn()``, tried again on transient errors within ``policy``; ``what`` and ``where`` (the URL) name
    the call in its errors.

    A missing object raises ``FileNotFoundError``; a permanent error a :class:`StorageError` at once;
    a transient one that outlasts the policy a :class:`StorageError` naming the tries and the budget.
    """
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            failure = classify(exc)
            if failure is Failure.MISSING:
                raise FileNotFoundError(f"{what}: no such object {where}") from exc
            if failure is Failure.PERMANENT:
                raise _final(f"{what} {where} failed: {describe(exc)} (not retried: waiting does not "
                             "mend it)") from exc
            elapsed = time.monotonic() - started
            delay = policy.next_delay(attempt, elapsed)
            if delay is None:
                raise _final(f"{what} {where} failed after {attempt} attempts: {describe(exc)}; gave up "
                             f"after {elapsed:.1f} s (retry budget ${RETRY_ENV}: {policy.budget_s:g} s)") from exc
            log.debug("%s %s: transient %r, retry %d in %.2fs", what, where, exc, attempt, delay)
            time.sleep(delay)


def _final(message: str) -> StorageError:
    return StorageError(message, final=True)  # a refusal, or the budget spent: trying again at once repeats it


def final_reason(exc: BaseException) -> str | None:
    """Why trying the storage call that raised ``exc`` again at once would repeat it, or None when it might not.

    ``""`` for a final :class:`StorageError` (its message says why already). For an error of pyarrow's S3
    filesystem built by ``data/storage/filesystem.py`` (the AWS SDK's text: Ray Train's checkpoint upload),
    whose retry strategy retries what may heal for :func:`sdk_attempts` tries of the budget: a refusal
    "not retried", anything else the tries and the budget it spent. Anything else (a local disk's error,
    a worker's own bug): None.
    """
    if isinstance(exc, StorageError):
        return "" if exc.final else None
    if not (isinstance(exc, OSError) and _SDK_ERROR.search(str(exc))):
        return None
    text = str(exc)
    # The SDK retries an endpoint it cannot reach too (`sdk_attempts`), though waiting seldom mends it.
    if _classify_sdk_text(text) is not Failure.TRANSIENT and "NETWORK_CONNECTION" not in text:
        return "not retried: waiting does not mend it"
    budget = retry_budget_s()
    return f"gave up after {sdk_attempts(budget)} tries per request (retry budget ${RETRY_ENV}: {budget:g} s)"


def sdk_attempts(budget_s: float) -> int:
    """Tries per request for pyarrow's ``AwsStandardS3RetryStrategy`` that end within ``budget_s``.

    The AWS SDK for C++ (its ``StandardRetryStrategy``) sleeps up to ``2**r`` seconds (jittered,
    capped at 20 s) before retry ``r + 1``; this counts the retries whose longest sleeps still add up
    to at most the budget. Its own sorting of errors agrees with :func:`classify` except that it also
    retries an endpoint that does not resolve or refuses connections, within the same bound.
    """
    attempts, slept = 1, 0.0
    while slept + min(2.0 ** (attempts - 1), 20.0) <= budget_s:
        slept += min(2.0 ** (attempts - 1), 20.0)
        attempts += 1
    return attempts
