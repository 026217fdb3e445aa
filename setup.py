"""Build hook: ship the top-level ``pipelines/`` inside the wheel as ``vitscale/pipelines/``.

Everything else about the package is in pyproject.toml. ``pipelines/`` stays at the top of the
repository (users, docs and ``vitscale run pipelines/<name>.yaml`` name it there); a non-editable
install finds the copy next to the package (vitscale/stages/run.py::resolve_pipeline_path).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PIPELINES = Path(__file__).resolve().parent / "pipelines"


class BuildPyWithPipelines(build_py):
    """``build_py`` plus a copy of every pipeline YAML under ``build_lib/vitscale/pipelines``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads pipelines/ in place
            return
        for src in sorted(PIPELINES.rglob("*.yaml")):
            dest = Path(self.build_lib, "vitscale", "pipelines", src.relative_to(PIPELINES))
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPyWithPipelines})
