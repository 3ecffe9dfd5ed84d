# The two commands of the README, each doing its own set-up from a fresh clone:
#   make demo    radixkv's main job on embedded defaults (no server needed)
#   make test    the whole test suite (the tests start the servers they need themselves)
# Variables: PYTHON (the interpreter that makes the venv), VENV, TORCH_VERSION (torch==2.13.0 is a
# CPU wheel here; a bare "torch" would pull a multi-GB CUDA build), EXTRAS.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
EXTRAS ?= test,lmdb,s3,yaml,hf,notebooks
PY := $(VENV)/bin/python
comma := ,
STAMP := $(VENV)/.radixkv-installed-$(TORCH_VERSION)-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test bench venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "torch==$(TORCH_VERSION)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m radixkv demo

test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(PY) -m pytest -q tests radixkv backends

bench: $(STAMP)
	$(PY) -m radixkv.bench hash --out benchmarks/results/hash_cpu.txt
	$(PY) -m radixkv.bench index --out benchmarks/results/index_cpu.txt
	$(PY) -m radixkv.bench copy --out benchmarks/results/copy_cpu.txt

clean:
	rm -rf $(VENV) build *.egg-info
