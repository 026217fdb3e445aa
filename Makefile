# Two entry points for a fresh machine; each installs what it needs into .venv first.
#   make quickstart   the embedded default: pipelines/quickstart.yaml on a local Ray (CPU is fine)
#   make test         the test suite (what CI runs)
# GPU users: skip this file and `pip install -e .` into an environment with your CUDA torch.

PYTHON ?= python3
VENV ?= .venv
# CPU machines pin torch first so pip never pulls the multi-GB CUDA build; set TORCH_CONSTRAINTS= to skip.
TORCH_CONSTRAINTS ?= constraints/cpu.txt
PIP = $(VENV)/bin/python -m pip
CONSTRAIN = $(if $(TORCH_CONSTRAINTS),-c $(TORCH_CONSTRAINTS))

.PHONY: install install-test-tools cpu-adam quickstart lint test test-fast test-cluster bench gpu-wheels private-cluster

# PYTHONWARNINGS=ignore: setuptools' notices about editable installs are for package authors, not for
# whoever runs this.
$(VENV)/.installed: pyproject.toml $(TORCH_CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH_CONSTRAINTS),$(PIP) install -q -r $(TORCH_CONSTRAINTS))
	PYTHONWARNINGS=ignore $(PIP) install -q $(CONSTRAIN) -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Debian's prometheus package (prometheus + promtool) for tests/test_monitoring.py; kubectl (with its
# kustomize) renders k8s/ for the k8s tests. Installed with apt-get where this user may (root, as CI runs,
# or passwordless sudo); elsewhere one line says what is skipped and the suite goes on: those tests skip
# and say why (tests/helpers/tools.py).
install-test-tools:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v kubectl >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
	  echo "install-test-tools: not installing prometheus/kubectl (not root, no passwordless sudo): the tests that need promtool, prometheus or kubectl will skip"; \
	  exit 0; fi; \
	set -ex; $$SUDO apt-get update; \
	command -v promtool >/dev/null || $$SUDO apt-get install -y prometheus; \
	command -v kubectl >/dev/null || $$SUDO apt-get install -y kubectl || echo "kubectl not found: install it to run the k8s/ tests"

# DeepSpeed's CPU Adam (what `train.offload: true` steps the host's master weights with), built once into
# torch's extension cache (~/.cache/torch_extensions). Without it the first offloaded run's workers each
# JIT-build it inside their start-up: a minute or more on 2 cores, counted against a test's timeout.
cpu-adam: install
	@PYTHONWARNINGS=ignore $(VENV)/bin/python -c "from vitscale.train.engine import build_cpu_adam; build_cpu_adam()" \
	  || echo "cpu-adam: DeepSpeed could not build its CPU Adam (see above; it needs a C++ compiler): the offload tests will say the same"

quickstart: install
	$(VENV)/bin/vitscale run pipelines/quickstart.yaml

# Two workers, whole files each (module fixtures run once): Ray's start-up waits of one leave the
# cores to the other's tests.
# The linter and the type checker first (pyproject.toml's [tool.ruff] and [tool.mypy]): a failure there is
# seconds, not the suite's minutes.
lint: install
	$(VENV)/bin/ruff check vitscale tests benchmarks docs
	$(VENV)/bin/mypy

test: lint install-test-tools cpu-adam
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# vitscale on a cluster of nodes with private disks (a whole node SIGKILLed mid-pre-training, the whole
# pipeline and a study kept in the bucket, a node lost under sweep trials; needs root), and an elastic
# run that shrinks and grows on a local multi-node Ray.
test-cluster: install
	VITSCALE_CLUSTER_E2E=1 $(VENV)/bin/python -m pytest -q tests/test_private_cluster.py tests/test_elastic_ray.py

test-fast: install cpu-adam
	$(VENV)/bin/python -m pytest -q -m "not slow"

bench: install
	$(VENV)/bin/python benchmarks/data_throughput.py
	$(VENV)/bin/python benchmarks/train_overhead.py

# Wheels a bare GPU machine (CUDA torch, no DeepSpeed, no registry) needs for benchmarks/gpu_check.sh, into .whl/
# (git-ignored): DeepSpeed as a py3-none-any wheel with no ops built (DS_BUILD_OPS=0), and the packages it and
# vitscale import that such an image lacks, for its Python (GPU_PYTHON, 3.12 on the machines measured).
GPU_PYTHON ?= 3.12
GPU_WHEELS = pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 \
	simplejpeg==1.9.0 boto3==1.44.8 botocore==1.44.8 jmespath==1.1.0 s3transfer==0.19.3
gpu-wheels: install
	DS_BUILD_OPS=0 $(PIP) wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

# A head and two worker nodes on this machine, each in its own mount namespace with a private /tmp and
# $HOME, token authentication on: the shape of a KubeRay or `ray up` cluster (needs root). Prints the
# address and token; Ctrl-C stops it. tests/test_private_cluster.py checks the shape.
private-cluster: install
	$(VENV)/bin/python tests/helpers/private_cluster.py up
