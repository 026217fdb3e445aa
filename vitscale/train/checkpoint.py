"""Training checkpoints that are only ever used when complete.

Layout of one checkpoint directory (every rank writes its own part into a local folder; Ray Train
merges the folders of all ranks into one directory of the run's storage):

    deepspeed/state/...          DeepSpeed's files: module states (rank 0) and one ZeRO shard per rank
    rank{r}.pt                   this rank's stream state and RNG states (and Polyak average, if on)
    train_state.json             step, epoch, examples seen, cumulative FLOPs, samples skipped (rank 0)
    config.yaml                  the resolved pipeline config, and what the weights are (`trained:`; rank 0)
    MANIFEST-rank{r}.json        SHA-256 of every file rank r wrote -- written LAST by that rank

A checkpoint is complete when the manifests of all ranks are present, readable and agree on the
step, and every file they list has the recorded size and hash. `latest_complete` skips anything else
(a rank that died mid-save, an interrupted upload), so a resume never loads half a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from vitscale.config.location import is_url
from vitscale.data.storage.atomic import PART_SUFFIX, atomic_path, write_atomic
from vitscale.data.storage.mirror import RunFileNotStored
from vitscale.data.storage.retry import final_reason
from vitscale.data.storage.space import (
    free_bytes,
    free_text,
    is_no_space,
    no_space_line,
    out_of_files,
    resumes,
    size_text,
)

DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"
TRAIN_STATE = "train_state.json"


@dataclass(frozen=True)
class TrainState:
    """Where training stands after `step` optimizer steps."""

    step: int = 0
    examples_seen: int = 0
    flops: float = 0.0
    world_size: int = 1
    skipped_steps: int = 0
    """Steps not applied because their loss or gradients were not finite (the run's whole history)."""
    first_skipped_step: int | None = None
    """The first such step; checkpoints written before it outrank later ones in rotation."""
    skipped_samples: int = 0
    """Samples skipped (undecodable, bad labels), all ranks together, in the epochs finished by `step`; the
    epoch in progress keeps its own count in the stream state (``skipped``)."""



def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message ('' when it has none): torch's unpickling errors run long."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""

def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks so multi-GB shards do not sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def state_sha256(module: torch.nn.Module) -> str:
    """Hex SHA-256 of a module's state (names, dtypes, shapes and bytes, in name order): the same weights give the
    same digest whatever file they were read from (an export's bytes differ each time it is written)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    return digest.hexdigest()


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states (dropout and any host-side randomness)."""
    # NumPy's key array travels as a tensor so the file loads with torch.load(weights_only=True).
    # legacy=True: the tuple form (str, key array, ...), not the dict
    name, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos,
                                                     has_gauss, gauss), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rng(seed: int, step: int, rank: int) -> None:
    """Python, NumPy and torch RNGs from (seed, step, rank): a rank that joins a resized run has no
    saved state of its own, and must not copy another rank's (identical dropout masks)."""
    entropy = np.random.SeedSequence([seed, step, rank]).generate_state(2)
    value = int(entropy[0]) << 32 | int(entropy[1])
    random.seed(value)
    np.random.seed(int(entropy[0]))
    torch.manual_seed(value)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rank_part(directory: Path, *, rank: int, stream_state: dict[str, Any], train_state: TrainState,
                    config_yaml: str, polyak: dict[str, torch.Tensor] | None = None) -> None:
    """Write this rank's non-DeepSpeed files, then its manifest over everything it wrote.

    Call after the engine has saved into `directory / DEEPSPEED_DIR` (all ranks save: ZeRO shards
    optimizer state per rank).
    """
    directory = Path(directory)
    part: dict[str, Any] = {"stream": stream_state, "rng": rng_state()}
    if polyak is not None:
        part["polyak"] = polyak  # every rank keeps the (identical) average it resumes from: no cross-rank read
    # Each file whole or not at all (data/storage/atomic.py); the manifest, last, says the set is complete.
    with atomic_path(directory / f"rank{rank}.pt") as tmp:
        torch.save(part, tmp)
    if rank == 0:
        write_atomic(directory / TRAIN_STATE, json.dumps(asdict(train_state), indent=2))
        write_atomic(directory / "config.yaml", config_yaml)
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.name.startswith("MANIFEST-") and not path.name.endswith(PART_SUFFIX):
            rel = path.relative_to(directory).as_posix()
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"rank": rank, "step": train_state.step, "world_size": train_state.world_size, "files": files}
    write_atomic(directory / f"MANIFEST-rank{rank}.json", json.dumps(manifest, indent=1))  # whole or not at all


def read_manifest(path: Path) -> dict[str, Any] | None:
    """A rank's manifest, or None when it is unreadable, truncated or not a manifest.

    A damaged manifest makes its checkpoint incomplete (resume and export fall back to an older
    one); it must never end a run in a JSONDecodeError.
    """
    try:
        manifest = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    if not all(isinstance(manifest.get(k), int) and not isinstance(manifest.get(k), bool)
               for k in ("rank", "step", "world_size")):
        return None
    if not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
               for v in manifest["files"].values()):
        return None
    return manifest


def check_complete(directory: Path, world_size: int, *, hash_ranks: Iterable[int] | None = None,
                   allow_world_size_change: bool = False) -> list[str]:
    """Problems that make `directory` unusable as a checkpoint (empty list = complete).

    Every rank's manifest must be there, readable, and agree with the others on the step, and every
    listed file must be present at its recorded size. The SHA-256 is re-computed for the files of
    `hash_ranks` (None = all ranks): a resuming rank reads only rank 0's module states and its own
    shard, so it hashes those instead of the whole checkpoint once per rank.

    By default the checkpoint must have been written by `world_size` workers. With
    `allow_world_size_change` (a resume that reshards, `reshard.load_resharded`) it may have been
    written by any number: then every rank of the saved world size (as its manifests record it)
    must be present, and all of them must agree on that number.
    """
    directory = Path(directory)
    saved_world_size = world_size
    if allow_world_size_change:
        info = manifest_info(directory)
        if info is None:
            return [f"{directory}: no readable manifest"]
        saved_world_size = info[1]
    to_hash = set(range(saved_world_size)) if hash_ranks is None else set(hash_ranks)
    problems = []
    steps: dict[int, int] = {}
    for rank in range(saved_world_size):
        path = directory / f"MANIFEST-rank{rank}.json"
        if not path.exists():
            problems.append(f"{directory}: no manifest from rank {rank}")
            continue
        manifest = read_manifest(path)
        if manifest is None:
            problems.append(f"{path}: unreadable or truncated manifest")
            continue
        steps[rank] = manifest["step"]
        if manifest["world_size"] != saved_world_size:
            if allow_world_size_change:
                problems.append(f"{path}: written by {manifest['world_size']} workers, other ranks' manifests "
                                f"say {saved_world_size}")
            else:
                problems.append(f"{directory}: written by {manifest['world_size']} workers, this run has "
                                f"{world_size} (a ZeRO checkpoint resumes on the same number of workers)")
        for rel, info in manifest["files"].items():
            file = directory / rel
            try:  # a live run's rotation may delete the file between any two of these looks
                size = file.stat().st_size
                if size != info["bytes"]:
                    problems.append(f"{file}: {size} bytes, manifest says {info['bytes']}")
                elif rank in to_hash and sha256_file(file) != info["sha256"]:
                    problems.append(f"{file}: SHA-256 differs from rank {rank}'s manifest")
            except FileNotFoundError:
                problems.append(f"{file}: listed by rank {rank} but missing")
    if len(set(steps.values())) > 1:
        problems.append(f"{directory}: ranks' manifests disagree on the step: "
                        + ", ".join(f"rank {r} step {s}" for r, s in sorted(steps.items())))
    return problems


def manifest_info(directory: Path) -> tuple[int, int] | None:
    """(step, world size) a possibly incomplete checkpoint was written at, from any readable manifest;
    None if it has none."""
    for path in sorted(Path(directory).glob("MANIFEST-rank*.json")):
        manifest = read_manifest(path)
        if manifest is not None:
            return manifest["step"], manifest["world_size"]
    return None


def latest_complete(candidates: list[Path], world_size: int | None = None,
                    hash_ranks: Iterable[int] | None = None) -> Path | None:
    """The newest complete checkpoint among `candidates` (by step), or None.

    `world_size` None takes each candidate's own, as recorded in its manifests (for export).
    """
    infos = [(manifest_info(c), c) for c in candidates]
    for (_step, written_by), path in sorted(((i, c) for i, c in infos if i is not None), reverse=True):
        if not check_complete(path, world_size or written_by, hash_ranks=hash_ranks):
            return path
    return None


def read_train_state(directory: Path) -> TrainState:
    return TrainState(**json.loads((Path(directory) / TRAIN_STATE).read_text()))


def read_rank_part(directory: Path, rank: int) -> dict[str, Any]:
    """This rank's stream state and RNG states (plain data and tensors: loaded with weights_only)."""
    path = Path(directory) / f"rank{rank}.pt"
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: refusing to load: it holds objects that are not tensors or plain data "
                         f"({_first_line(exc) or 'unpickling refused'})") from None


# ----------------------------------------------------------------------------------------- a full disk

_LAST_PART_BYTES: dict[str, int] = {}
"""This worker process's part of the last checkpoint it saved, in bytes (the next one is about as big)."""


class DiskFull(OSError):
    """A checkpoint did not fit where it was being written: one line naming the place and the space
    needed. A restart would fail the same way until space is freed (`launch/failures.py` stops the
    run); the checkpoint being written is incomplete (no manifest, or files the manifests do not
    match), so a resume skips it for the last complete one."""


class CheckpointNotWritten(OSError):
    """A checkpoint's copy into the run's storage failed: one line naming the storage and the last error.
    The one that failed is never complete, its manifests and files do not all arrive.

    ``final`` when the storage's error will not heal (a refusal such as 403) or the retry budget was spent
    on it (``data/storage/retry.py``, ``final_reason``): the run stops at once (``launch/failures.py``), a
    restart would wait as long and fail the same way. Otherwise Ray Train restarts the workers (within
    ``cluster.max_failures``) from the last complete checkpoint."""

    final: bool = False

    def __init__(self, *args: object, final: bool = False) -> None:
        super().__init__(*args)
        self.final = final


def tree_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory``."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


@contextlib.contextmanager
def space_for(where: str | os.PathLike[str], *, step: int, parts: int = 1,
              copying: Path | None = None) -> Iterator[None]:
    """Guard one write of a checkpoint (``parts`` ranks' parts) into ``where``: a full disk becomes one
    :class:`DiskFull` line naming ``where``, the space needed and the space free; any other storage
    error one :class:`CheckpointNotWritten` line naming ``where`` and the error.

    The need is this rank's part times ``parts``: the part being copied (``copying``, a finished
    local checkpoint), else the last checkpoint's. When ``where`` has less free space than that,
    nothing is written at all; otherwise the disk's own error is turned into the same line.
    """
    part = tree_bytes(copying) if copying is not None else _LAST_PART_BYTES.get("part")
    needed = None if part is None else part * parts
    free = free_bytes(where)
    if (needed is not None and free is not None and free < needed) or out_of_files(where):
        raise _disk_full(where, step, needed, free, parts)
    try:
        yield
    except Exception as exc:
        # The run's own files pushed before the checkpoint (launch/train_worker.py, `_report`) fail as what they are.
        if isinstance(exc, (DiskFull, CheckpointNotWritten, RunFileNotStored)):
            raise
        free = free_bytes(where)
        # Only a full disk (ENOSPC, EDQUOT: of bytes or of files) is DiskFull; an error with a cause of its
        # own (EIO, a permission, EFBIG) keeps it. torch.save reports a full disk with no errno at all
        # ("unexpected pos", "file write failed"): such a writer's error on a disk left with (almost)
        # nothing free was the full disk.
        if is_no_space(exc) or (_names_no_cause(exc) and free is not None and free < max(needed or 0, 1 << 20)):
            raise _disk_full(where, step, needed, free, parts, exc) from exc
        if isinstance(exc, OSError):  # storage that failed for good (object storage after its retries)
            text = " ".join(str(exc).split())[:400] or type(exc).__name__
            why = final_reason(exc)
            raise CheckpointNotWritten(f"the checkpoint of step {step} was not written to {os.fspath(where)}: "
                                       f"{text}" + (f" ({why})" if why else ""), final=why is not None) from exc
        raise


_ERRNO_TEXT = re.compile(r"\[errno \d+\]", re.IGNORECASE)


def _names_no_cause(exc: BaseException) -> bool:
    """Whether ``exc`` is a writer's failure that says nothing of its cause: torch's C++ writer (a
    ``RuntimeError``) or an ``OSError`` without an errno, with no errno anywhere in its chain, neither
    as an attribute nor in its words (pyarrow writes ``[errno 5] Input/output error`` into the text)."""
    if not isinstance(exc, RuntimeError) and not (isinstance(exc, OSError) and exc.errno is None):
        return False
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if (isinstance(cause, OSError) and cause.errno is not None) or _ERRNO_TEXT.search(str(cause)):
            return False
        cause = cause.__cause__ or cause.__context__
    return True


def record_part(directory: Path) -> int:
    """Remember this rank's part of the checkpoint just saved in ``directory`` (the next need); its bytes."""
    _LAST_PART_BYTES["part"] = size = tree_bytes(directory)
    return size


def _disk_full(where: str | os.PathLike[str], step: int, needed: int | None, free: int | None,
               parts: int, exc: BaseException | None = None) -> DiskFull:
    need = (f"it needs about {size_text(needed)}" + (f" ({parts} ranks' parts)" if parts > 1 else "")
            if needed is not None else "the first checkpoint's size is not known yet")
    said = " ".join(str(exc).split())[:300] if exc is not None else ""
    error = DiskFull(f"no space for the checkpoint of step {step} in {os.fspath(where)}: {need}, "
                     f"{free_text(where, free)}" + (f" ({said})" if said else "") + f"; {resumes(where)}")
    error.errno = errno.ENOSPC
    return error


def one_line(exc: BaseException, run_storage: str, parts: int = 1) -> str:
    """``Type: message`` of a worker's error; a full disk met outside a checkpoint (metrics, logs, Ray's
    own files) also names the file, its device's free space and what the run needs (``parts`` ranks'
    next checkpoint), as :class:`DiskFull` does."""
    if isinstance(exc, (DiskFull, CheckpointNotWritten)) or not is_no_space(exc):
        return f"{type(exc).__name__}: {exc}"
    where = getattr(exc, "filename", None) or run_storage
    detail = " ".join(str(exc).split())[:300]
    return f"DiskFull: {no_space_line(where, detail, needed=next_checkpoint_bytes(run_storage, parts))}"


def next_checkpoint_bytes(run_storage: str | os.PathLike[str], parts: int = 1) -> int | None:
    """About what the run's next checkpoint needs: ``parts`` times this process's part of the last one it
    saved, else the size of the newest checkpoint in a local ``run_storage``; None when neither is known."""
    if "part" in _LAST_PART_BYTES:
        return _LAST_PART_BYTES["part"] * parts
    text = os.fspath(run_storage)
    if is_url(text):
        return None
    with contextlib.suppress(OSError):
        # checkpoint_{step:09d}: the name orders by step (Ray's checkpoint_manager_snapshot.json is no checkpoint)
        folders = [p for p in Path(text).glob("checkpoint_*") if p.name[len("checkpoint_"):].isdigit() and p.is_dir()]
        if folders:
            return tree_bytes(max(folders))
    return None
