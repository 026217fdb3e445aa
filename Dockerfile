# The vitscale image: Ray (head and workers), DeepSpeed and the vitscale package with its pipelines,
# for KubeRay (k8s/) and the Ray cluster launcher (cluster/).
#
#   docker build -t vitscale:0.1.0 .                                 GPU: CUDA torch (the default)
#   docker build --build-arg FLAVOR=cpu -t vitscale:0.1.0-cpu .      CPU only: kind/minikube quickstart
#
# GPU base: PyTorch's official image ships a CUDA build of torch (CUDA 12.8: sm_90 kernels for H100 and
# H200, NCCL included) on conda Python 3.11. It is the *devel* variant because DeepSpeed compiles the
# ops it has no prebuilt kernel for on first use, and DeepSpeedCPUAdam (train.offload: true) needs
# nvcc and the CUDA headers for that; the -runtime variant is about half the size and works for every
# pipeline that does not offload. Bump GPU_BASE to a newer torch tag as they appear (any torch >= 2.3
# runs vitscale; the tests ran on 2.13).
#
# CPU base: plain Python with torch from PyTorch's CPU wheel index (PyPI's Linux wheels are the
# multi-GB CUDA builds), pinned by constraints/cpu.txt like `make install` does.
#
# Both: the base image's torch is pinned while everything else installs into a venv owned by the
# non-root runtime user (uid 1000, group 100), so the Ray cluster launcher's setup_commands can
# `pip install -e` a synced checkout over it without root.

ARG FLAVOR=gpu
ARG GPU_BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-devel
ARG CPU_BASE=python:3.11-slim-bookworm

FROM ${GPU_BASE} AS base-gpu

FROM ${CPU_BASE} AS base-cpu
COPY constraints/cpu.txt /tmp/cpu.txt
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu -r /tmp/cpu.txt
# DeepSpeed must not go looking for CUDA on these nodes.
ENV DS_ACCELERATOR=cpu

FROM base-${FLAVOR}
ARG RAY_VERSION=2.60.0
ARG DEEPSPEED_VERSION=0.19.8
# The version is vitscale/_version.py's (tests/test_deploy_configs.py checks this label and the tags).
LABEL org.opencontainers.image.title="vitscale" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="Vision Transformer pre-training on Ray Train + DeepSpeed ZeRO"

USER root
# wget: KubeRay's injected readiness/liveness probes call it. rsync: the Ray cluster launcher syncs
# file_mounts into the container with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget rsync \
    && rm -rf /var/lib/apt/lists/*
# Ubuntu 24.04-based images already own uid 1000 as "ubuntu".
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --gid 100 --create-home --shell /bin/bash ray \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /etc/vitscale-torch.txt \
    && mkdir -p /app && chown 1000:100 /app

ENV VIRTUAL_ENV=/home/ray/venv \
    PATH=/home/ray/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    RAY_USAGE_STATS_ENABLED=0
# KubeRay starts Ray with `bash -lc`; a login shell may reset PATH, this puts the venv back first.
RUN printf 'export PATH=%s/bin:$PATH\n' "${VIRTUAL_ENV}" > /etc/profile.d/10-vitscale-venv.sh

USER 1000:100
WORKDIR /app
# Dependencies first, against a stub package, so editing vitscale's code does not reinstall them.
# The stub keeps vitscale/_version.py: pyproject.toml reads the version from it.
COPY --chown=1000:100 pyproject.toml setup.py MANIFEST.in README.md /app/
COPY --chown=1000:100 vitscale/_version.py /app/vitscale/_version.py
RUN python -m venv --system-site-packages "${VIRTUAL_ENV}" \
    && touch /app/vitscale/__init__.py \
    && pip install --no-cache-dir -c /etc/vitscale-torch.txt -e /app \
        "ray[default,train,tune]==${RAY_VERSION}" "deepspeed==${DEEPSPEED_VERSION}"
# Editable: `vitscale run <name>` finds pipelines/ next to the package, here /app/pipelines.
COPY --chown=1000:100 . /app
RUN vitscale config pipelines/pretrain.yaml > /dev/null

CMD ["/bin/bash"]
