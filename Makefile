# make book: build the book into _build/html (own venv, .venv-book, with .[book]).
# make test: every CPU test: pytest on tests/, nbval on notebooks/, the book build with -W, its
#            pages in headless Chromium (own venv, .venv, with .[test,book]). This is what CI
#            runs (.ci/run).
# Each venv is made once; a stamp file inside it, newer than pyproject.toml, skips reinstalling.

PYTHON    ?= python3
VENV      ?= .venv
BOOK_VENV ?= .venv-book
# torch goes into .venv first, on its own. Tests need only a CPU build: where pip's find-links
# (PIP_FIND_LINKS or pip config) offer one for this Python, take it; PyPI's default build is a
# CUDA build of several GB, and some releases pin CUDA toolkit wheels that clash with
# cuda-tile[tileiras]. Override with pip arguments, e.g. make test TORCH='torch==2.13.0' or
# make test TORCH='torch --index-url https://download.pytorch.org/whl/cpu'.
FIND_LINKS = $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
PYTAG      = $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
TORCH     ?= $(or $(firstword $(wildcard $(addsuffix /torch-*+cpu-$(PYTAG)-*.whl,$(FIND_LINKS)))),torch)
BOOK_FLAGS ?= -W --keep-going

NOTEBOOKS := $(wildcard notebooks/*.ipynb)

.PHONY: book test test-py test-nb test-book test-browser gpu gpu-check gpu-models-1 gpu-models-2 gpu-bench gpu-study gpu-results gpu-tilegym resources clean

book: $(BOOK_VENV)/.stamp
	$(BOOK_VENV)/bin/jupyter-book build . $(BOOK_FLAGS)

test: test-py test-nb test-book test-browser

test-py: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest -m "not gpu" -n auto tests/

test-nb: $(VENV)/.stamp
ifneq ($(NOTEBOOKS),)
	$(VENV)/bin/python -m pytest --nbval-lax --nbval-current-env -n auto --dist loadfile notebooks/
else
	@echo "nbval: no notebooks in notebooks/, nothing to run"
endif

# --all: as a test, build from scratch (an incremental build keeps pages whose source is gone)
test-book: $(VENV)/.stamp
	$(VENV)/bin/jupyter-book build . $(BOOK_FLAGS) --all

# The built book in headless Chromium (Debian's chromium package, driven by Playwright): every
# page loads offline, MathJax typesets, images load, no unresolved reference, no code line wider
# than the page. .ci/run installs chromium where it is missing.
.PHONY: test-browser
test-browser: test-book
	$(VENV)/bin/python -m ssd.book.browser_check _build/html

$(VENV)/.stamp: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q $(TORCH)
	$(VENV)/bin/python -m pip install -q -e '.[test,book]'
	touch $@

$(BOOK_VENV)/.stamp: pyproject.toml
	test -x $(BOOK_VENV)/bin/python || $(PYTHON) -m venv $(BOOK_VENV)
	$(BOOK_VENV)/bin/python -m pip install -q --upgrade pip
	$(BOOK_VENV)/bin/python -m pip install -q -e '.[book]'
	touch $@

# make gpu: on a GPU machine, in an environment with .[gpu,test] installed, record
# every GPU number the book reads, all at one revision (commit first: each recording
# names it), then execute the GPU chapters so their stored outputs come from the same
# run. Each part is sized for under ten minutes on a fresh H100 or H200, for machines
# that cap a command's time:
#   gpu-check     the GPU tests (gpu_tests.json, gpu_mixer_tests.json,
#                 gpu_decode_tests.json; one process per core: compiling the kernel
#                 variants dominates) and first calls
#   gpu-models-1  the models suite against mamba_ssm and TileGym, some shapes, and
#   gpu-models-2  the others, merged into one models.json (about two minutes a shape,
#                 most of it compiling and mamba_ssm's autotuning)
#   gpu-bench     the serving suite, and TileGym tuned replayed beside ours
#   gpu-study     the layout study, the SSD's share of the layer and a prefill grid
#   gpu-results   chapters 04-08 executed (they time kernels live, record what they show)
# The layer calls our SSD at chunk 64 and mamba_ssm's at 256, each one's fastest on
# most models shapes (chapter 10).
GPU_PYTHON ?= python3
MODELS_1 ?= 130m,2.7b,long-16k
MODELS_2 ?= codestral-7b,small-state
gpu: gpu-check gpu-models-1 gpu-models-2 gpu-bench gpu-study gpu-results
gpu-check:
	$(GPU_PYTHON) -m ssd doctor
	$(GPU_PYTHON) -m pytest -m gpu -n auto -q tests/
	$(GPU_PYTHON) -m ssd.tools.bench --suite first-call
gpu-models-1:
	$(GPU_PYTHON) -m ssd.tools.bench --suite models --reps 30 --shapes $(MODELS_1) --merge
gpu-models-2:
	$(GPU_PYTHON) -m ssd.tools.bench --suite models --reps 30 --shapes $(MODELS_2) --merge
gpu-bench:
	$(GPU_PYTHON) -m ssd.tools.bench --suite serving --reps 30
	$(GPU_PYTHON) -m ssd.tools.bench --suite models --impl ssd --impl tilegym_tuned --quick --reps 30 \
	  --tilegym-replay --out results/$$($(GPU_PYTHON) -m ssd.tools.env --slug)/tilegym_replayed.json
gpu-study:
	$(GPU_PYTHON) -m ssd.tools.bench --suite study --reps 20
	$(GPU_PYTHON) -m ssd.tools.endtoend --only share --reps 10 --chunk-size cutile=64
	$(GPU_PYTHON) -m ssd.tools.endtoend --only prefill --quick --layers 8 --prefill-reps 5 \
	  --chunk-size cutile=64
gpu-results:
	$(GPU_PYTHON) -m ssd.book.run '0[4-8]*.ipynb'

# make resources: the registers, shared memory and compile time of every kernel of the layout
# study's points for sm_90 (results/compile/sm_90_resources.json, chapter 9). A CPU compile with
# no GPU needed; run it at the revision make gpu records.
resources: $(VENV)/.stamp
	$(VENV)/bin/python -m ssd.tools.aot --resources

# make gpu-tilegym: TileGym's own autotuner on each models shape (an exhaustive search, minutes a
# shape), its chosen configurations kept in results/tilegym_tuned.json for gpu-bench to replay.
# Not part of make gpu: tune again only for a new TileGym version or another GPU.
TILEGYM_SHAPES ?= 2.7b 130m long-16k small-state codestral-7b
TILEGYM_RUNS ?= _build/tilegym-runs
gpu-tilegym:
	for s in $(TILEGYM_SHAPES); do \
	  $(GPU_PYTHON) -m ssd.tools.bench --suite models --shapes $$s --impl ssd --impl tilegym_tuned --quick \
	    --reps 30 --out $(TILEGYM_RUNS)/$$s.json || exit 1; \
	done
	$(GPU_PYTHON) -m ssd.tools.bench --tilegym-table $(TILEGYM_RUNS)

clean:
	rm -rf _build .jupyter_cache
