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

.PHONY: book test test-py test-nb test-book gpu gpu-check gpu-bench gpu-study gpu-results gpu-tilegym gpu-tilegym-replay clean

book: $(BOOK_VENV)/.stamp
	$(BOOK_VENV)/bin/jupyter-book build . $(BOOK_FLAGS)

test: test-py test-nb test-book test-browser

test-py: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest -m "not gpu" tests/

test-nb: $(VENV)/.stamp
ifneq ($(NOTEBOOKS),)
	$(VENV)/bin/python -m pytest --nbval-lax --nbval-current-env notebooks/
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

# make gpu: on a GPU machine, in an environment with .[gpu,test] installed, regenerate every GPU
# number in the book: the GPU tests (results/<gpu>/gpu_tests.json), the benchmark suites and the
# tiling study (results/<gpu>/<suite>.json), the first-call compile times, the complete-job
# measurements, then re-execute the GPU chapters so their stored outputs and recordings come from
# this run. Needs a GPU; CI never runs it. About half an hour on an H200, in four parts of 4 to
# over 10 minutes (make gpu-check, gpu-bench, gpu-study, gpu-results; the study, which compiles
# every point it times, took over 7 minutes on a fresh machine) for machines that cap a
# command's time: the GPU tests run in one process per CPU core (pytest-xdist) because compiling
# the kernel variants they use dominates; the repetition counts and the prefill grid (8-layer
# stacks, the quick grid) are the ones the recorded results/h200 files were made with, so a run
# here is comparable with them line for line (python -m ssd.tools.endtoend without options sweeps the
# full grid at the published depths). The layer calls our SSD at 64, its fastest chunk size on
# four of the five models shapes (results/h200/models.json; the suites time ours, like mamba_ssm,
# at 64, 128 and 256 and count its fastest), and mamba_ssm's at the layer's 256, its fastest on all
# five.
GPU_PYTHON ?= python3
gpu: gpu-check gpu-bench gpu-study gpu-results
gpu-check:
	$(GPU_PYTHON) -m ssd doctor
	$(GPU_PYTHON) -m pytest -m gpu -n auto tests/
	$(GPU_PYTHON) -m ssd.tools.bench --suite first-call
gpu-bench:
	$(GPU_PYTHON) -m ssd.tools.bench --suite models --reps 30
	$(GPU_PYTHON) -m ssd.tools.bench --suite serving --reps 30
	$(GPU_PYTHON) -m ssd.tools.bench --suite seqlen --reps 30 --quick
gpu-study:
	$(GPU_PYTHON) -m ssd.tools.bench --suite study --reps 20
	$(GPU_PYTHON) -m ssd.tools.endtoend --only share --reps 10 --chunk-size cutile=64
	$(GPU_PYTHON) -m ssd.tools.endtoend --only prefill --quick --layers 8 --prefill-reps 5 --chunk-size cutile=64
gpu-results:
	$(GPU_PYTHON) -m ssd.book.run '0[4-9]*.ipynb' '1[0-9]*.ipynb'

# make gpu-tilegym: TileGym's tuned mode beside ours, one process per models shape, each written
# to results/<gpu>/tilegym_tuned/<shape>.json with TileGym's chosen configurations. Not part of
# make gpu: TileGym tunes every shape exhaustively, about 2.5-3 minutes a shape on an H200 (tuning time
# in first_call_s, never in the steady-state times).
TILEGYM_SHAPES ?= 2.7b 130m long-16k small-state codestral-7b
gpu-tilegym:
	gpu=$$($(GPU_PYTHON) -c 'from ssd.tools.env import environment, gpu_slug; print(gpu_slug(environment()))'); \
	for s in $(TILEGYM_SHAPES); do \
	  $(GPU_PYTHON) -m ssd.tools.bench --suite models --shapes $$s --impl ssd --impl tilegym_tuned --quick \
	    --reps 30 --out results/$$gpu/tilegym_tuned/$$s.json || exit 1; \
	done

# make gpu-tilegym-replay: TileGym tuned beside ours in one process for the models shapes, each
# with the configurations TileGym's search chose in results/<gpu>/tilegym_tuned/<shape>.json (make
# gpu-tilegym) instead of searching again: about a minute instead of a quarter of an hour, so our
# kernels can be set beside TileGym tuned at every revision. Written to
# results/<gpu>/tilegym_replayed.json (records say tuning="replayed"; the tuning time stays in the
# searched files). The benchmark refuses to replay a run of another TileGym version: tune again.
gpu-tilegym-replay:
	gpu=$$($(GPU_PYTHON) -c 'from ssd.tools.env import environment, gpu_slug; print(gpu_slug(environment()))'); \
	$(GPU_PYTHON) -m ssd.tools.bench --suite models --impl ssd --impl tilegym_tuned --quick --reps 30 \
	  --tilegym-replay results/$$gpu/tilegym_tuned --out results/$$gpu/tilegym_replayed.json

clean:
	rm -rf _build .jupyter_cache
