"""vitscale's version: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), ``vitscale --version`` and
``vitscale.__version__`` show it; the Dockerfile's label and image tags and the k8s overlays' image
tags cannot import Python, so tests/test_deploy_configs.py checks that they name this version.
"""

__version__ = "0.1.0"
