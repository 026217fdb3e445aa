"""The wheel as a new user gets it: built, installed (not editable) into a fresh venv, used from a
folder with no pipelines/ in it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import vitscale

# Building and installing a wheel takes ~25 s of a 2-core machine's time.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    # Without PYTHONPATH: a checkout on it (a worktree's suite run) would be the vitscale the fresh venv imports.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False,
                          env=env)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: a build writes build/ and *.egg-info next to the sources.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("vitscale", "pipelines"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    # Offline: no build isolation (setuptools from this environment), no dependencies.
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src)
    (whl,) = dist.glob("vitscale-*.whl")
    return whl


def test_wheel_ships_pipelines_and_declares_the_right_minimums(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.removeprefix("vitscale/pipelines/") for n in names if n.startswith("vitscale/pipelines/")}
    expected = {p.relative_to(ROOT / "pipelines").as_posix() for p in (ROOT / "pipelines").rglob("*.yaml")}
    assert shipped == expected and "quickstart.yaml" in shipped and "recipes/jft-vit-l16.yaml" in shipped
    assert f"vitscale-{vitscale.__version__}-" in wheel.name
    (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = zipfile.ZipFile(wheel).read(meta_name).decode()
    assert re.search(r"^Version: " + re.escape(vitscale.__version__) + "$", meta, re.MULTILINE)
    assert "Requires-Python: >=3.11" in meta
    requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.MULTILINE)
    assert "numpy>=2.0" in requires
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if r.startswith("webdataset")]  # nothing in vitscale imports it
    assert 'webdataset>=1.0; extra == "dev"' in requires  # the tests' and benchmarks' peer


def test_installed_wheel_runs_shipped_pipelines_from_anywhere(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    purelib = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    # The dependencies (torch, Ray, ...) come from this environment's site-packages, after the venv's
    # own: a path line in a .pth, so this environment's editable vitscale finder is never loaded.
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel)
    elsewhere = tmp_path / "elsewhere"  # no pipelines/ here
    elsewhere.mkdir()
    where = _run(py, "-c", "import vitscale; print(vitscale.__file__, vitscale.__version__)", cwd=elsewhere)
    assert where.startswith(str(purelib / "vitscale")) and where.split()[1] == vitscale.__version__
    vitscale_cmd = venv / "bin" / "vitscale"
    assert _run(vitscale_cmd, "--version", cwd=elsewhere).strip() == f"vitscale {vitscale.__version__}"
    assert "pipeline" in _run(vitscale_cmd, "run", "--help", cwd=elsewhere)
    # The shipped quickstart (and a recipe that extends ../pretrain.yaml) resolve, load and validate.
    assert re.search(r"^name: quickstart$", _run(vitscale_cmd, "config", "quickstart", cwd=elsewhere), re.MULTILINE)
    assert "ViT-L/16" in _run(vitscale_cmd, "config", "jft-vit-l16", cwd=elsewhere)
