# Two commands matter: `make serve` (set up, then start the stack on the embedded default)
# and `make test` (set up, then run every test). Set-up is idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
SERVE_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup serve test unit lint bench model

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Pinned: on a machine without a GPU this takes the CPU wheel, never a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m modeling.model_store > /dev/null
	# A real compose parser for the compose-file test (Debian's docker-compose; no engine needed).
	command -v docker-compose > /dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose > /dev/null; }
	touch $(STAMP)

model: setup
	$(PY) -m modeling.model_store

serve: setup
	$(VENV)/bin/specserve up $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -p no:cacheprovider -q

unit: setup
	$(PY) -m pytest -q tests/unit

lint: setup
	$(PY) -m mypy proto/messages.py proto/lifecycle.py common modeling gpu_worker draft_service distill scheduler gateway specserve --ignore-missing-imports

bench: setup
	$(PY) -m bench.grpc_bench --start $(BENCH_ARGS)
