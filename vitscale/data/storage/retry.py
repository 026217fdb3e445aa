"""Retrying object-store calls: the backoff policy and which errors are worth another try.

Transient failures (HTTP 5xx, throttling, dropped connections, read timeouts, short bodies) are
retried with exponential backoff and full jitter for a bounded number of attempts.
"""

from __future__ import annotations

import http.client
import random
from dataclasses import dataclass

from vitscale.config.checks import non_negative, positive_int

__all__ = ["RetryPolicy", "ShortRead", "is_missing", "is_transient"]

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
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchBucket"})


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter for transient object-store errors."""

    max_attempts: int = 8
    """Total tries per operation, the first one included."""
    base_delay_s: float = 0.05
    """Upper bound of the first backoff; doubles per attempt (full jitter draws in [0, bound])."""
    max_delay_s: float = 5.0
    """Cap on any single backoff."""

    def __post_init__(self) -> None:
        positive_int(self.max_attempts, "RetryPolicy.max_attempts")
        non_negative(self.base_delay_s, "RetryPolicy.base_delay_s")
        non_negative(self.max_delay_s, "RetryPolicy.max_delay_s")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        bound = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return (rng or random).uniform(0.0, bound)


class ShortRead(Exception):
    """A body ended before the length the server announced (a dropped connection in disguise)."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: 5xx, throttling, dropped connections, short reads.

    Wrappers such as boto3's ``S3UploadFailedError`` (raised by managed uploads) are judged by
    the error they wrap.
    """
    from boto3.exceptions import S3UploadFailedError

    if isinstance(exc, S3UploadFailedError):
        inner = exc.__cause__ or exc.__context__
        # Without a chained cause the message is all we have; managed uploads mostly fail on
        # the network, so treat it as transient (attempts stay bounded).
        return True if inner is None else is_transient(inner)
    return _is_transient_leaf(exc)


def _is_transient_leaf(exc: BaseException) -> bool:
    import botocore.exceptions as bce
    import urllib3.exceptions as u3e

    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        code = str(err.get("Code", ""))
        return status >= 500 or status == 429 or code in _TRANSIENT_CODES or code.startswith("5")
    return isinstance(
        exc,
        (
            bce.ConnectionError,  # endpoint unreachable, connect timeout, proxy, SSL
            bce.HTTPClientError,  # connection closed, read timeout, response streaming error
            bce.IncompleteReadError,
            u3e.HTTPError,  # protocol errors while streaming a body
            http.client.IncompleteRead,
            http.client.RemoteDisconnected,
            ConnectionError,  # builtin: reset/aborted/refused
            TimeoutError,
            ShortRead,
        ),
    )


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the object (or bucket) does not exist."""
    import botocore.exceptions as bce

    if isinstance(exc, bce.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _MISSING_CODES or status == 404
    return False
