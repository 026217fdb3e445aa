"""One writer per run: a lease on ``storage_path/run_name`` held for the writer's whole life.

Two drivers writing the same run rotate each other's checkpoints away mid-write. Every verb that
writes into a run (``vitscale run``, ``finetune``, sweeps and study cells, which run through it)
therefore holds the run's lease first; a second writer is refused with one line naming the holder
(host, pid, since when).

- **A local (or NFS) folder**: an exclusive ``fcntl.flock`` on ``RUN/.vitscale-lease``, whose
  content names the holder. The kernel drops the lock when the holder's process dies, however it
  dies (SIGKILL included), so a crashed driver never blocks the next one and there is nothing to
  force.
- **``s3://``**: the lease object ``RUN/.vitscale-lease`` created with a conditional put
  (``If-None-Match: *``: exactly one creator wins), renewed by a heartbeat thread with a
  compare-and-swap put (``If-Match: <etag>``) every ``ttl_s / 3`` seconds, deleted on release
  (``If-Match`` again). A lease not renewed for ``ttl_s`` (its holder crashed) is taken over by the
  next writer, again by compare-and-swap, so two late-comers cannot both take it. Its age is read
  from the server's own clock (the response's ``Date`` minus the object's ``Last-Modified``), so
  clocks that disagree between machines do not matter. ``force=True`` (``vitscale run --force``)
  takes over a lease that has not expired yet: for a holder known to be dead, when waiting
  ``ttl_s`` is not wanted. A holder on this machine whose process is alive is never forced out.
  A holder that provably died on this very machine is taken over at once, without ``force``: the
  lease records the machine (boot id and pid namespace, not just the host name, which containers and
  clones share) and the holder's process start time, so a pid reused by another process since is
  not mistaken for the holder (``Holder.dead_here``).

No writer inside another live one's folder, nor around one: once its lease is held, a writer looks for
a live lease in the folders above it (up to the filesystem root or the bucket; a local lease is live
while its lock is held, probed with a shared lock for an instant; an S3 one while renewed within its
ttl) and in those below it, and is refused in one line naming that run and its holder (its own lease
given back, the folders it made removed). A study's cell, inside the study's run whose driver holds
that lease, says so (``part_of``): folders from the study's run upwards are not looked at.

A writer whose heartbeat finds the lease taken over (or cannot renew it for ``ttl_s``) has lost
it: ``on_lost`` is called (the CLI's default interrupts the driver) so that it stops writing.
Servers that ignore ``If-None-Match`` (old S3 look-alikes) are caught by reading the lease back
after creating it: the writer whose token is not there is refused.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import posixpath
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from vitscale.config.location import canonical_location
from vitscale.data.storage.base import StorageError
from vitscale.data.storage.cleanup import missing_folders, remove_new_folders
from vitscale.data.storage.holder import DEFAULT_TTL_S, Holder
from vitscale.data.storage.nesting import live_above, live_below, read_lease_object, who
from vitscale.data.storage.retry import RetryPolicy
from vitscale.data.storage.s3 import S3Storage
from vitscale.data.storage.space import free_bytes, free_text, is_no_space, out_of_files, size_text
from vitscale.say import line

__all__ = ["DEFAULT_TTL_S", "LEASE_NAME", "Holder", "LeaseHeld", "RunLease", "hold_run_lease"]

LEASE_NAME = ".vitscale-lease"
"""The lease file (local) or object (S3) inside the run's folder."""

class LeaseHeld(StorageError):
    """Another writer holds the run's lease (a StorageError: the CLI prints it as one line)."""

    def __init__(self, message: str, holder: str | None = None):
        super().__init__(message)
        self.holder = holder
        """Who holds the lease of this very place, as messages name it ("pid 123 on host h since ..."); None when
        the refusal is a live writer's folder around or inside this one. What a writer of this place writes will
        be there once it ends, so a run that only needs that dataset may wait for it (`stages/datasets.py`)."""


_ADVICE = {
    "run": "wait for it to finish, choose another cluster.run_name, or, if that process is dead, run again with "
           "--force",
    "dataset": "wait for it to finish or write to another --out",
}
"""What a refused writer can do, by what it writes: a run (`vitscale run`) or a dataset (`shards write`)."""


def _refusal(url: str, holder: Holder | None, detail: str, kind: str = "run") -> LeaseHeld:
    return LeaseHeld(f"{kind} {url} is being written by {who(holder)} ({detail}); {_ADVICE[kind]}", who(holder))


def _unwritable(path: Path, exc: OSError, holder: Holder) -> StorageError:
    """One line for a lease that cannot be written; on a full disk, in the words of every full-disk line
    (`space.py`): the space free there and the space the lease needs (its holder's record, a folder's
    entry and the file's inode: under a kilobyte)."""
    if not is_no_space(exc):
        return StorageError(f"cannot write the run's lease {path}: {exc.strerror or exc}")
    needed = len(holder.encode())
    advice = "remove files there" if out_of_files(path) else "free space there"
    return StorageError(f"cannot write the run's lease {path}: {exc.strerror or exc} "
                        f"({free_text(path, free_bytes(path))}, it needs about {size_text(needed)}); "
                        f"{advice} and run again")


class RunLease:
    """A held lease; ``release()`` (or leaving the ``with`` block) gives it back."""

    url: str
    holder: Holder

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _LocalLease(RunLease):
    """An exclusive ``flock`` on ``FOLDER/.vitscale-lease``; the file is removed on release.

    Removing it means a writer may lock a file that was just unlinked by the holder releasing it, so
    after locking, the lock is only kept if the path still names the locked file (else: try again).
    """

    def __init__(self, folder: Path, holder: Holder, kind: str = "run") -> None:
        self.url, self.holder = str(folder), holder
        self.path = folder / LEASE_NAME
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unwritable(self.path, exc, self.holder) from exc
        for _ in range(100):
            fd = self._lock(kind)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the file we locked was removed by a holder releasing it: lock the new one
        else:
            raise StorageError(f"{self.path}: the lease file kept changing; try again")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        except OSError as exc:  # a full disk: the run could not write anything either
            with contextlib.suppress(OSError):
                self.path.unlink()  # while still locked, as release() does: no empty lease file is left behind
            os.close(fd)  # closing drops the lock
            raise _unwritable(self.path, exc, self.holder) from exc
        self._fd: int | None = fd

    def _lock(self, kind: str) -> int:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise _unwritable(self.path, exc, self.holder) from exc
        try:
            _flock_soon(fd, fcntl.LOCK_EX)
        except BlockingIOError:
            current = Holder.decode(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _refusal(self.url, current, f"it holds an exclusive lock on {self.path}; the lock goes when "
                           "its process ends, so --force cannot take it", kind) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        import fcntl

        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink()  # while still locked: the next writer's check above sees it gone
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # cannot remove it: at least name no holder
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _flock_soon(fd: int, how: int) -> None:
    """``flock(fd, how)`` without waiting on a holder: ``BlockingIOError`` when the lock stays taken for
    a few tries over ~0.2 s (a writer inside this folder probing whether it is live holds the lock for
    an instant: `nesting.live_local`; a live run holds it for good)."""
    import fcntl

    for attempt in range(20):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == 19:
                raise
            time.sleep(0.01)


class _S3Lease(RunLease):
    def __init__(self, storage: S3Storage, holder: Holder, force: bool,
                 on_lost: Callable[[str], None], log: Callable[[str], None], kind: str = "run") -> None:
        self.storage, self.holder, self.url, self.kind = storage, holder, storage.url, kind
        self.key = storage.key_of(LEASE_NAME)
        self.where = storage.url_of(LEASE_NAME)
        self.on_lost, self.log = on_lost, log
        self.etag = self._acquire(force)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="vitscale-lease", daemon=True)
        self._thread.start()

    # -- S3 calls: None where a condition failed (412, or 409 for a concurrent conditional write)

    def _conditional(self, what: str, fn: Callable[[], Any]) -> Any:
        import botocore.exceptions as bce

        def call() -> Any:
            try:
                return fn()
            except bce.ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status in (409, 412) or exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    return None
                raise

        return self.storage._retrying(what, LEASE_NAME, call)

    def _put(self, **condition: str) -> str | None:
        resp = self._conditional("lease", lambda: self.storage.client.put_object(
            Bucket=self.storage.bucket, Key=self.key, Body=self.holder.encode(), **condition))
        return None if resp is None else str(resp["ETag"])

    def _read(self) -> tuple[Holder | None, str, float] | None:
        """(holder, etag, seconds since it was last renewed, by the server's clock), or None if gone."""
        return read_lease_object(self.storage, LEASE_NAME)

    def _acquire(self, force: bool) -> str:
        for _ in range(5):  # each pass loses only to a writer that changed the lease meanwhile
            current = self._read()
            if current is None:
                etag = self._put(IfNoneMatch="*")
                if etag is not None and self._still_mine():
                    return etag
                continue
            holder, etag, age = current
            ttl = holder.ttl_s if holder is not None else self.holder.ttl_s
            if holder is not None and holder.token == self.holder.token:
                return etag
            dead = holder is not None and age <= ttl and holder.dead_here()
            if age <= ttl and not force and not dead:
                raise _refusal(self.url, holder, f"lease {self.where} renewed {age:.0f} s ago; it expires "
                               f"{ttl:.0f} s after its last renewal", self.kind)
            if age <= ttl and holder is not None and holder.alive_here():
                raise _refusal(self.url, holder, "that process is alive on this machine: --force only takes "
                               "over a lease whose holder is dead", self.kind)
            taken = self._put(IfMatch=etag)
            if taken is not None and self._still_mine():
                who = holder.describe() if holder is not None else "an unreadable holder"
                why = ("its process is gone from this machine" if dead else "forced" if age <= ttl
                       else f"not renewed for {age:.0f} s")
                self.log(line(f"took over the lease of {self.url} from {who} ({why})"))
                return taken
        raise StorageError(f"lease {self.where}: other writers kept changing it; try again")

    def _still_mine(self) -> bool:
        """Read back: a server that ignores conditional headers lets the last writer win; the others
        see a token not theirs and are refused."""
        current = self._read()
        if current is not None and current[0] is not None and current[0].token == self.holder.token:
            return True
        if current is not None:
            raise _refusal(self.url, current[0], f"lease {self.where} taken at the same moment", self.kind)
        return False

    def _heartbeat(self) -> None:
        period = self.holder.ttl_s / 3
        last_ok = time.monotonic()
        while not self._stop.wait(period):
            try:
                etag = self._put(IfMatch=self.etag)
            except (StorageError, OSError) as exc:
                if time.monotonic() - last_ok > self.holder.ttl_s:
                    self._lost(f"could not renew it for {self.holder.ttl_s:.0f} s ({exc})")
                    return
                continue  # a transient outage: the next beat tries again, well inside the ttl
            if etag is None:
                current = self._read()
                who = current[0].describe() if current is not None and current[0] is not None else "another writer"
                self._lost(f"it was taken over by {who}")
                return
            self.etag, last_ok = etag, time.monotonic()

    def _lost(self, why: str) -> None:
        self._stop.set()
        self.on_lost(f"vitscale: error: lost the lease of {self.kind} {self.url}: {why}; stopping so that two "
                     f"writers never share the {self.kind}")

    def release(self) -> None:
        if self._stop.is_set() and not self._thread.is_alive():
            return
        self._stop.set()
        self._thread.join()
        try:
            self._conditional("lease", lambda: self.storage.client.delete_object(
                Bucket=self.storage.bucket, Key=self.key, IfMatch=self.etag))
        except (StorageError, OSError) as exc:  # it expires by itself after ttl_s
            self.log(line(f"could not remove {self.where} ({exc}); it expires in {self.holder.ttl_s:.0f} s"))


_NESTED_ADVICE = {
    "run": "a run's files would mix with the other run's; choose a cluster.storage_path outside it, or wait "
           "for that run to finish",
    "dataset": "write to an --out outside it, or wait for that writer to finish",
}
"""What a writer refused for being inside another live writer's folder can do."""


def _refuse_inside_live(url: str, kind: str, part_of: str | None, endpoint_url: str | None,
                        retry: RetryPolicy | None) -> None:
    """Refuse a writer of ``url`` inside the folder of another live run (or dataset write), in one line
    naming it: the outer run's rotation, mirror and resume would take the inner one's files for its own."""
    found = live_above(url, LEASE_NAME, part_of=part_of, endpoint_url=endpoint_url, retry=retry)
    if found is not None:
        outer, who = found
        raise LeaseHeld(f"{kind} {url} lies inside {outer}, which is being written by {who} (its lease "
                        f"{posixpath.join(outer, LEASE_NAME)} is live); {_NESTED_ADVICE[kind]}")


def _refuse_around_live(lease: RunLease, kind: str) -> None:
    """Refuse a writer whose folder already holds another live writer's folder, in one
    line naming it: this run's rotation and resume would take the inner one's files for its own. Its own
    lease is held by then, so of two writers starting at once, one inside the other, one sees the other."""
    found = live_below(lease.url, LEASE_NAME, lease.storage if isinstance(lease, _S3Lease) else None)
    if found is not None:
        where, who = found
        raise LeaseHeld(f"{kind} {lease.url} holds {where}, which is being written by {who} (its lease "
                        f"{posixpath.join(where, LEASE_NAME)} is live); {_AROUND_ADVICE[kind]}")


_AROUND_ADVICE = {
    "run": "choose another cluster.run_name or cluster.storage_path, or wait for that run to finish",
    "dataset": "write to another --out, or wait for that writer to finish",
}
"""What a writer refused for holding another live writer's folder can do."""


def _interrupt(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    _thread.interrupt_main()


def hold_run_lease(run_url: str, *, force: bool = False, endpoint_url: str | None = None,
                   ttl_s: float = DEFAULT_TTL_S, on_lost: Callable[[str], None] = _interrupt,
                   log: Callable[[str], None] = print, retry: RetryPolicy | None = None,
                   kind: str = "run", part_of: str | None = None) -> RunLease:
    """Take the lease of the run at ``run_url`` (a folder, or ``s3://bucket/prefix/run_name``).

    Raises :class:`LeaseHeld` naming the holder when another writer has it (see the module doc for
    expiry and ``force``), or when a folder above ``run_url`` is a live writer's (a run inside another
    live run; ``force`` does not apply to it), or when one inside it is (a run around a live one). Both
    are looked for once its own lease is held; when refused, that lease is given back and the folders
    taking it created are removed: nothing is left. ``part_of``:
    the run this one is a part of (a study's cell inside the study's run), whose lease its own driver
    holds: folders from it upwards are not looked at. Use as ``with hold_run_lease(url): ...`` or call
    ``release()``. ``kind`` ("run" or "dataset") is what the messages call the thing written.
    """
    if kind not in _ADVICE:
        raise ValueError(f"kind must be one of {sorted(_ADVICE)}, got {kind!r}")
    if ttl_s <= 0:
        raise ValueError(f"a lease's ttl_s must be positive, got {ttl_s}")
    holder = Holder.me(ttl_s)
    run_url = canonical_location(run_url, "run storage")
    if part_of is not None:
        part_of = canonical_location(part_of, "run storage")
    created = [] if run_url.startswith("s3://") else missing_folders(run_url)
    if run_url.startswith("s3://"):
        bucket, _, prefix = run_url[len("s3://"):].partition("/")
        storage = S3Storage(bucket, prefix, endpoint_url=endpoint_url, retry=retry)
        lease: RunLease = _S3Lease(storage, holder, force, on_lost, log, kind)
    else:
        lease = _LocalLease(Path(run_url), holder, kind)
    # Both looks come once this lease is held: of two writers starting at once, one inside the other, the
    # one that looks last sees the other's lease.
    try:
        _refuse_inside_live(run_url, kind, part_of, endpoint_url, retry)
        _refuse_around_live(lease, kind)
    except BaseException:
        lease.release()
        remove_new_folders(created)  # nothing left inside the live run: not even the folder the lease made
        raise
    return lease
