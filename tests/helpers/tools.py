"""System tools some tests run for real (promtool, prometheus, kubectl): found, installed where this user
may, or the test skipped with the reason.

`make install-test-tools` installs them with apt-get as root or with passwordless sudo (CI runs as root);
without either, the tests that need them skip and say why instead of failing. Where installing was
allowed and failed, the test fails: a machine that should have the tool does not.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest


@functools.cache
def apt_prefix() -> list[str] | str:
    """The command prefix apt-get runs with here ([] as root, ["sudo", "-n"] with passwordless sudo), or
    why this user cannot install a package."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return "this user cannot install it (not root, no passwordless sudo)"


_updated: list[bool] = []


def need_tools(package: str, *names: str) -> list[str]:
    """The paths of the executables `names` (from the Debian package `package`), installing the package
    when one is missing and this user may (apt-get update once, then apt-get install -y); a test that
    asks for them skips, naming what is missing and why, where this user may not install it."""
    if all(shutil.which(n) for n in names):
        return [shutil.which(n) for n in names]  # type: ignore[misc]
    missing = ", ".join(n for n in names if not shutil.which(n))
    prefix = apt_prefix()
    if isinstance(prefix, str):
        pytest.skip(f"{missing} not installed and {prefix}: run `make install-test-tools` as root, "
                    f"or install the {package} package")
    commands = ([] if _updated else [["apt-get", "update"]]) + [["apt-get", "install", "-y", package]]
    for cmd in commands:
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"{missing} is missing and `{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
        if cmd[1] == "update":
            _updated.append(True)
    if not all(shutil.which(n) for n in names):
        pytest.fail(f"apt-get install {package} did not install {missing}")
    return [shutil.which(n) for n in names]  # type: ignore[misc]
