"""The study's state: one JSON record per cell in the study directory (a folder or s3://).

    STUDY_DIR/plan.json              the plan (every cell, its settings and planned compute)
    STUDY_DIR/state/CELL.json        the driver's record: status, runs, failures, times, results
    STUDY_DIR/state/CELL.stages.json the cell's finished stages, written by the cell as each ends
    STUDY_DIR/cells/CELL/            the cell's runs (checkpoints, metrics, sweep trials)

Time: `wall_s` and `device_hours` sum every attempt of a cell, killed ones included. While an
attempt runs the driver writes its elapsed time to `open_attempt_s` every `HEARTBEAT_S`; the next
attempt (after a killed driver) adds that to the sums before starting, so a kill loses at most a
heartbeat's worth of time from the record (one small write per running cell every 5 s).

Status: "pending" (never started), "running" (started; after a killed driver this means
interrupted: a re-run resumes it from its checkpoints), "done", "failed" (its last run failed;
run again while `failures <= study.retries`, then it has failed for good). Records are written
whole and atomically by the storage layer, so a reader (`vitscale study report` while the study
runs) never sees half a record; a file damaged otherwise (a bad copy, an edit) is refused in one line
naming it and the way back (`StudyStateError`): the plan is written again by the next run, a cell's
record or stages can be deleted for the cell to run again from its checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from vitscale.config.errors import UserError

T = TypeVar("T")

STATUSES = ("pending", "running", "done", "failed")
HEARTBEAT_S = 5.0
"""Seconds between the driver's writes of a running cell's elapsed time."""


@dataclass
class CellRecord:
    """What the study knows of one cell."""

    id: str
    status: str = "pending"
    runs: int = 0
    """Times the cell was started (resumes included)."""
    failures: int = 0
    """Runs that ended in an error."""
    started_at: float | None = None
    """When its first run started."""
    finished_at: float | None = None
    wall_s: float = 0.0
    """Wall time summed over its closed attempts (pre-training and transfer), killed ones included."""
    pretrain_wall_s: float = 0.0
    """The finished run's pre-training wall time (its last attempt's, when resumed)."""
    device_hours: float = 0.0
    """Wall hours x devices (GPUs, or workers on CPU) summed over its closed attempts."""
    devices: float = 0.0
    """Devices one run of the cell holds."""
    open_attempt_s: float = 0.0
    """Seconds of the attempt running now (or killed), as of the driver's last heartbeat; not yet
    in `wall_s` and `device_hours`."""
    run_name: str | None = None
    """The directory under cells/ its runs live in when not its id (a study an earlier vitscale began)."""
    examples_seen: int | None = None
    """Pre-training examples actually seen (the final step's count)."""
    exaflops: float | None = None
    """Pre-training compute from the examples actually seen (the paper's convention)."""
    accuracies: dict[str, float] = field(default_factory=dict)
    """Transfer accuracy per "DATASET PROTOCOL" column, e.g. "digits fewshot 5shot", "digits sweep"."""
    error: str | None = None
    """The last run's error (one line)."""

    def open_attempt(self, devices: float) -> None:
        """A new attempt starts: the previous one's heartbeat time (a killed attempt) is counted."""
        self.close_attempt(self.open_attempt_s)
        self.devices = devices

    def close_attempt(self, seconds: float) -> None:
        """An attempt of `seconds` ended (finished, failed, or found killed): add it to the sums."""
        self.wall_s += seconds
        self.device_hours += seconds / 3600 * self.devices
        self.open_attempt_s = 0.0

    def total_wall_s(self) -> float:
        """Every attempt's wall time, the running one's as of its last heartbeat."""
        return self.wall_s + self.open_attempt_s

    def total_device_hours(self) -> float:
        return self.device_hours + self.open_attempt_s / 3600 * self.devices

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, default=str).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CellRecord:
        """The record `to_json` wrote; `ValueError` naming the field for anything else (fields it does not
        know, from a later vitscale, are left out)."""
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError(f"a cell's record is a JSON object, got {type(raw).__name__}")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        record = cls(**known)
        record._check()
        return record

    def _check(self) -> None:
        # JSON as Python writes it may hold NaN and Infinity, and an edit anything: a record holds finite
        # counts and times >= 0 and accuracies in [0, 1]; anything else would be fitted, ranked and plotted.
        def number(value: Any, optional: bool = False, top: float = math.inf) -> bool:
            return (value is None and optional) or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                    and math.isfinite(value) and 0 <= value <= top)

        wrong = [name for name, ok in (
            ("id", isinstance(self.id, str)), ("status", self.status in STATUSES),
            *((n, isinstance(getattr(self, n), int) and not isinstance(getattr(self, n), bool)
               and getattr(self, n) >= 0) for n in ("runs", "failures")),
            *((n, number(getattr(self, n))) for n in ("wall_s", "pretrain_wall_s", "device_hours", "devices",
                                                      "open_attempt_s")),
            *((n, number(getattr(self, n), optional=True)) for n in ("started_at", "finished_at", "examples_seen",
                                                                     "exaflops")),
            ("run_name", self.run_name is None or isinstance(self.run_name, str)),
            ("error", self.error is None or isinstance(self.error, str)),
            ("accuracies", isinstance(self.accuracies, dict)
             and all(isinstance(k, str) and number(v, top=1.0) for k, v in self.accuracies.items())))
            if not ok]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} not of the kind a record holds (finite numbers >= 0, "
                             f"accuracies in [0, 1])")


class StudyState:
    """Reads and writes the study directory through vitscale's storage layer (local or S3)."""

    def __init__(self, url: str, endpoint_url: str | None = None):
        from vitscale.data.storage import open_storage

        self.url = url
        self.storage = open_storage(url, endpoint_url=endpoint_url)

    def cells_storage(self) -> str:
        """Where cells' runs live: `storage_path` of each cell's pipeline."""
        return f"{self.url.rstrip('/')}/cells"

    def _read(self, name: str, parse: Callable[[bytes], T], remedy: str) -> T:
        """`parse` of the file `name`; a `StudyStateError` naming it, and how to recover, when it cannot be."""
        data = self.storage.read_bytes(name)
        try:
            return parse(data)
        except (ValueError, TypeError, KeyError) as exc:  # json's errors are ValueErrors
            raise StudyStateError(f"{self.storage.url_of(name)} is unreadable ({type(exc).__name__}: {exc}); "
                                  f"{remedy}") from None

    def record(self, cell_id: str) -> CellRecord:
        name = f"state/{cell_id}.json"
        if not self.storage.exists(name):
            return CellRecord(cell_id)
        return self._read(name, CellRecord.from_json, "delete it and the cell runs again, resuming from its "
                                                      "checkpoints (the times its attempts took are then lost)")

    def record_or_migrate(self, cell_id: str, legacy_id: str | None) -> CellRecord:
        """The cell's record; when it has none but its legacy id has (a study begun by a vitscale
        whose ids hashed absolute data paths), that record, adopted under the new id: its runs
        stay in their directory (`run_name`), its finished stages are copied. The old files stay."""
        if legacy_id is None or self.storage.exists(f"state/{cell_id}.json") \
                or not self.storage.exists(f"state/{legacy_id}.json"):
            return self.record(cell_id)
        old = self.record(legacy_id)
        old.id, old.run_name = cell_id, old.run_name or legacy_id
        if self.storage.exists(f"state/{legacy_id}.stages.json"):
            self.storage.write_bytes(f"state/{cell_id}.stages.json",
                                     self.storage.read_bytes(f"state/{legacy_id}.stages.json"))
        self.write(old)
        return old

    def write(self, record: CellRecord) -> None:
        self.storage.write_bytes(f"state/{record.id}.json", record.to_json())

    def stages(self, cell_id: str) -> dict[str, Any]:
        """The cell's finished stages: name -> summary (the pretrain stage's names its checkpoint)."""
        name = f"state/{cell_id}.stages.json"
        if not self.storage.exists(name):
            return {}
        return self._read(name, _stages, "delete it and the cell's finished stages run again")

    def stage_done(self, cell_id: str, stage: str, summary: dict[str, Any]) -> None:
        done = self.stages(cell_id)
        done[stage] = {**summary, "finished_at": time.time()}
        self.storage.write_bytes(f"state/{cell_id}.stages.json", json.dumps(done, indent=1, default=str).encode())

    def write_plan(self, plan: dict[str, Any]) -> None:
        self.storage.write_bytes("plan.json", json.dumps(plan, indent=1, default=str).encode())

    def plan(self) -> dict[str, Any]:
        if not self.storage.exists("plan.json"):
            raise FileNotFoundError(f"no plan.json in {self.url}: not a study directory (or the study never started)")
        return self._read("plan.json", _plan, "`vitscale run` of the study's pipeline writes it again (the cells' "
                                              "records and runs are kept)")


PLAN_CELL: dict[str, type | tuple[type, ...]] = {"id": str, "label": str, "family": str, "epochs": (int, float),
                                                 "examples": int, "exaflops": (int, float)}
"""What a report reads of each planned cell (`plan.PlannedCell.row`), and of which kinds."""


def _plan(data: bytes) -> dict[str, Any]:
    plan = json.loads(data)
    if not isinstance(plan, dict) or not isinstance(plan.get("cells"), list):
        raise ValueError("a plan is a JSON object with a list of cells")
    for i, cell in enumerate(plan["cells"]):
        wrong = [k for k, kind in PLAN_CELL.items()
                 if not isinstance(cell, dict) or not isinstance(cell.get(k), kind) or isinstance(cell.get(k), bool)]
        if wrong:
            raise ValueError(f"cell {i}: {', '.join(wrong)} missing or not of the kind a plan holds")
    return plan


def _stages(data: bytes) -> dict[str, Any]:
    stages = json.loads(data)
    if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
        raise ValueError("a cell's finished stages are a JSON object of one summary per stage")
    return stages


class StudyStateError(UserError):
    """A file of the study's state cannot be read; the message names it and how to recover."""


def runnable(record: CellRecord, retries: int) -> bool:
    """Whether a (re-)run of the study runs this cell: not done, and not failed for good."""
    if record.status == "done":
        return False
    return not (record.status == "failed" and record.failures > retries)


def accuracies(stages: dict[str, Any], finetune_dataset: str | None) -> dict[str, float]:
    """Transfer accuracy per "DATASET PROTOCOL" column from a cell's stage summaries (pure)."""
    out: dict[str, float] = {}
    for url, per_shot in (stages.get("fewshot") or {}).items():
        if url == "untrained_baseline" or not isinstance(per_shot, dict):
            continue
        for k, v in per_shot.items():
            if k.endswith("shot") and isinstance(v, (int, float)) and math.isfinite(v):
                out[f"{dataset_name(url)} fewshot {k}"] = float(v)
    for stage in ("finetune", "sweep"):
        value = (stages.get(stage) or {}).get("test_accuracy")
        if isinstance(value, (int, float)) and math.isfinite(value) and finetune_dataset:
            out[f"{dataset_name(finetune_dataset)} {stage}"] = float(value)
    return out


def planned_columns(transfer: Sequence[str], fewshot_datasets: Sequence[str], shots: Sequence[int],
                    finetune_dataset: str | None) -> list[str]:
    """The accuracy columns a study's cells will report (`accuracies`' keys), known before any runs (pure)."""
    probes = {"fewshot": {url: {f"{k}shot": 0.0 for k in shots} for url in fewshot_datasets}}
    tested = {stage: {"test_accuracy": 0.0} for stage in ("finetune", "sweep") if stage in transfer}
    return list(accuracies({**(probes if "fewshot" in transfer else {}), **tested}, finetune_dataset))


def dataset_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]
