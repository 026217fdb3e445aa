"""The study's state: one JSON record per cell in the study directory (a folder or s3://).

    STUDY_DIR/plan.json              the plan (every cell, its settings and planned compute)
    STUDY_DIR/state/CELL.json        the driver's record: status, runs, failures, times, results
    STUDY_DIR/state/CELL.stages.json the cell's finished stages, written by the cell as each ends
    STUDY_DIR/cells/CELL/            the cell's runs (checkpoints, metrics, sweep trials)

Status: "pending" (never started), "running" (started; after a killed driver this means
interrupted: a re-run resumes it from its checkpoints), "done", "failed" (its last run failed;
run again while `failures <= study.retries`, then it has failed for good). Records are written
whole and atomically by the storage layer, so a reader (`vitscale study report` while the study
runs) never sees half a record.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("pending", "running", "done", "failed")


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
    """Wall time summed over its runs (pre-training and transfer)."""
    pretrain_wall_s: float = 0.0
    device_hours: float = 0.0
    """Pre-training wall hours x devices (GPUs, or workers on CPU), summed over runs."""
    examples_seen: int | None = None
    """Pre-training examples actually seen (the final step's count)."""
    exaflops: float | None = None
    """Pre-training compute from the examples actually seen (the paper's convention)."""
    accuracies: dict[str, float] = field(default_factory=dict)
    """Transfer accuracy per "DATASET PROTOCOL" column, e.g. "digits fewshot 5shot", "digits sweep"."""
    error: str | None = None
    """The last run's error (one line)."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, default=str).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CellRecord:
        raw = json.loads(data)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


class StudyState:
    """Reads and writes the study directory through vitscale's storage layer (local or S3)."""

    def __init__(self, url: str, endpoint_url: str | None = None):
        from vitscale.data.storage import open_storage

        self.url = url
        self.storage = open_storage(url, endpoint_url=endpoint_url)

    def cells_storage(self) -> str:
        """Where cells' runs live: `storage_path` of each cell's pipeline."""
        return f"{self.url.rstrip('/')}/cells"

    def record(self, cell_id: str) -> CellRecord:
        name = f"state/{cell_id}.json"
        if not self.storage.exists(name):
            return CellRecord(cell_id)
        return CellRecord.from_json(self.storage.read_bytes(name))

    def write(self, record: CellRecord) -> None:
        self.storage.write_bytes(f"state/{record.id}.json", record.to_json())

    def stages(self, cell_id: str) -> dict[str, Any]:
        """The cell's finished stages: name -> summary (the pretrain stage's names its checkpoint)."""
        name = f"state/{cell_id}.stages.json"
        return json.loads(self.storage.read_bytes(name)) if self.storage.exists(name) else {}

    def stage_done(self, cell_id: str, stage: str, summary: dict[str, Any]) -> None:
        done = self.stages(cell_id)
        done[stage] = {**summary, "finished_at": time.time()}
        self.storage.write_bytes(f"state/{cell_id}.stages.json", json.dumps(done, indent=1, default=str).encode())

    def write_plan(self, plan: dict[str, Any]) -> None:
        self.storage.write_bytes("plan.json", json.dumps(plan, indent=1, default=str).encode())

    def plan(self) -> dict[str, Any]:
        if not self.storage.exists("plan.json"):
            raise FileNotFoundError(f"no plan.json in {self.url}: not a study directory (or the study never started)")
        return json.loads(self.storage.read_bytes("plan.json"))


def runnable(record: CellRecord, retries: int) -> bool:
    """Whether a (re-)run of the study runs this cell: not done, and not failed for good."""
    if record.status == "done":
        return False
    return not (record.status == "failed" and record.failures > retries)
