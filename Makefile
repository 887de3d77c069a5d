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

.PHONY: book test test-py test-nb test-book test-browser resources clean

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
#   gpu-check-1..4     the GPU tests, a few test files a part (GPU_TESTS_1 ...), merged
#                      into gpu_tests, gpu_mixer_tests, gpu_decode_tests and
#                      gpu_backward_tests (.json.gz; one process per core: compiling the
#                      kernel variants dominates); part 1 starts them anew and times
#                      first calls
#   gpu-models-1       the models suite against mamba_ssm and TileGym, some shapes,
#   gpu-models-2       and the others, merged into one models.json (about two minutes
#                      a shape, most of it compiling and mamba_ssm's autotuning)
#   gpu-bench          the serving suite (our kernels compiled first: it reports no
#                      first calls), and TileGym tuned replayed beside ours
#   gpu-study          the layout study
#   gpu-layer          both layers and mamba_ssm's Mamba2: the SSD's share, the rest's
#                      floor; a prefill grid (endtoend.json)
#   gpu-serving        the decode step against mamba_ssm's (decode.json) and the
#                      serving scenario: a packed prefill, then decoding
#                      (serving_scenario.json); an eager forward's host time by
#                      phase (host_profile.json)
#   gpu-robust-1..5    the robust suite against mamba_ssm, every 5th shape from the
#                      1st, ..., from the 5th (6 shapes a part), merged into one
#                      robust.json. Ours runs at chunk 64, its kernels for a part's
#                      shapes compiled first in parallel; mamba_ssm at its best of
#                      64/128/256, autotuned on each shape: most of about a minute a
#                      shape (each part prints a shape's seconds by phase)
#   gpu-backward-1..3  forward + backward against mamba_ssm and TileGym untuned on
#                      the models shapes, some shapes each, merged into one
#                      backward.json (TileGym adds its compiles and about half a
#                      minute a shape)
#   gpu-train-mqar     the recall task trained with each backend from two seeds
#                      (training.json)
#   gpu-train-step-1   a training step of the stack at the models shapes, some
#   gpu-train-step-2   shapes each, merged into one training_step.json
#   gpu-results        chapters 04-08 executed (they time kernels live)
# The layer calls our SSD at chunk 64 and mamba_ssm's at 256, each one's fastest
# forward on most models shapes (chapter 10). The training step calls ours at 128,
# its fastest forward + backward on most of them, with less memory than at 64.
GPU_PYTHON ?= python3
MODELS_1 ?= 130m,2.7b,long-16k
MODELS_2 ?= codestral-7b,small-state
BACKWARD_1 ?= 130m,2.7b
BACKWARD_2 ?= long-16k,codestral-7b
BACKWARD_3 ?= small-state
# Every test file with GPU tests, in one part each (tests/test_gpu_record.py checks it).
GPU_TESTS_1 ?= tests/test_gpu_kernels.py tests/test_gpu_varlen.py tests/test_gpu_host_path.py \
  tests/test_primer.py tests/test_mamba2.py
GPU_TESTS_2 ?= tests/test_gpu_backward.py tests/test_gpu_stage_backward.py
GPU_TESTS_3 ?= tests/test_gpu_chunk_scan_backward.py tests/test_gpu_generation.py \
  tests/test_gpu_train.py
GPU_TESTS_4 ?= tests/test_gpu_layer_kernels.py tests/test_gpu_decode.py
.PHONY: gpu gpu-check-1 gpu-check-2 gpu-check-3 gpu-check-4 gpu-models-1 gpu-models-2 gpu-bench gpu-study gpu-layer gpu-serving \
  gpu-robust-1 gpu-robust-2 gpu-robust-3 gpu-robust-4 gpu-robust-5 gpu-backward-1 \
  gpu-backward-2 gpu-backward-3 gpu-train-mqar gpu-train-step-1 gpu-train-step-2 \
  gpu-results gpu-tilegym gpu-tilegym-backward gpu-backward-stages gpu-smoke
gpu: gpu-check-1 gpu-check-2 gpu-check-3 gpu-check-4 gpu-models-1 gpu-models-2 gpu-bench gpu-study gpu-layer gpu-serving \
  gpu-robust-1 gpu-robust-2 gpu-robust-3 gpu-robust-4 gpu-robust-5 gpu-backward-1 \
  gpu-backward-2 gpu-backward-3 gpu-train-mqar gpu-train-step-1 gpu-train-step-2 \
  gpu-results
gpu-check-1:
	$(GPU_PYTHON) -m ssd doctor
	$(GPU_PYTHON) -m pytest -m gpu -n auto --dist loadgroup -q $(GPU_TESTS_1)
	$(GPU_PYTHON) -m ssd.tools.bench --suite first-call
gpu-check-2:
	$(GPU_PYTHON) -m pytest -m gpu -n auto --dist loadgroup -q --gpu-merge $(GPU_TESTS_2)
gpu-check-3:
	$(GPU_PYTHON) -m pytest -m gpu -n auto --dist loadgroup -q --gpu-merge $(GPU_TESTS_3)
gpu-check-4:
	$(GPU_PYTHON) -m pytest -m gpu -n auto --dist loadgroup -q --gpu-merge $(GPU_TESTS_4)
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
gpu-layer:
	$(GPU_PYTHON) -m ssd.tools.endtoend --only share --reps 10 --chunk-size cutile=64
	$(GPU_PYTHON) -m ssd.tools.endtoend --only prefill --quick --layers 8 --prefill-reps 5 \
	  --chunk-size cutile=64
gpu-serving:
	$(GPU_PYTHON) -m ssd.tools.decode_bench --reps 50
	$(GPU_PYTHON) -m ssd.tools.serving --reps 10 --chunk-size cutile=64
	$(GPU_PYTHON) -m ssd.tools.host_profile
gpu-robust-1:
	$(GPU_PYTHON) -m ssd.tools.bench --suite robust --impl ssd --impl mamba_ssm \
	  --reps 30 --shard 1/5 --merge
gpu-robust-2:
	$(GPU_PYTHON) -m ssd.tools.bench --suite robust --impl ssd --impl mamba_ssm \
	  --reps 30 --shard 2/5 --merge
gpu-robust-3:
	$(GPU_PYTHON) -m ssd.tools.bench --suite robust --impl ssd --impl mamba_ssm \
	  --reps 30 --shard 3/5 --merge
gpu-robust-4:
	$(GPU_PYTHON) -m ssd.tools.bench --suite robust --impl ssd --impl mamba_ssm \
	  --reps 30 --shard 4/5 --merge
gpu-robust-5:
	$(GPU_PYTHON) -m ssd.tools.bench --suite robust --impl ssd --impl mamba_ssm \
	  --reps 30 --shard 5/5 --merge
gpu-backward-1:
	$(GPU_PYTHON) -m ssd.tools.backward_bench --reps 30 --shapes $(BACKWARD_1) --merge
gpu-backward-2:
	$(GPU_PYTHON) -m ssd.tools.backward_bench --reps 30 --shapes $(BACKWARD_2) --merge
gpu-backward-3:
	$(GPU_PYTHON) -m ssd.tools.backward_bench --reps 30 --shapes $(BACKWARD_3) --merge
gpu-train-mqar:
	$(GPU_PYTHON) -m ssd.tools.train mqar --seed 0 --seed 1 --no-progress
gpu-train-step-1:
	$(GPU_PYTHON) -m ssd.tools.train step --shapes $(MODELS_1) --chunk-size cutile=128 \
	  --no-progress
gpu-train-step-2:
	$(GPU_PYTHON) -m ssd.tools.train step --shapes $(MODELS_2) --chunk-size cutile=128 \
	  --no-progress
gpu-results:
	$(GPU_PYTHON) -m ssd.book.run '0[4-8]*.ipynb'

# make resources: the registers, shared memory and compile time of every kernel of the layout
# study's points for sm_90 (results/compile/sm_90_resources.json, chapter 9). A CPU compile with
# no GPU needed; run it at the revision make gpu records.
resources: $(VENV)/.stamp
	$(VENV)/bin/python -m ssd.tools.aot --resources

# make gpu-tilegym-backward: ours and TileGym's forward + backward with its autotuner
# searching every kernel's candidates, one shape a command (several minutes a shape),
# merged into backward_tilegym_tuned.json. Not part of make gpu, as gpu-tilegym.
TILEGYM_BACKWARD_SHAPES ?= 130m 2.7b long-16k codestral-7b small-state
gpu-tilegym-backward:
	for s in $(TILEGYM_BACKWARD_SHAPES); do \
	  $(GPU_PYTHON) -m ssd.tools.backward_bench --impl ssd --impl tilegym_tuned --reps 30 \
	    --shapes $$s --merge \
	    --out results/$$($(GPU_PYTHON) -m ssd.tools.env --slug)/backward_tilegym_tuned.json \
	    || exit 1; \
	done

# make gpu-backward-stages: each stage of our backward timed alone at chunk 64 and 256, and
# chunk_scan's backward at several head splits and tiles (ssd.tools.backward_stages): where
# the backward's time goes, to tune it (_build/backward_stages/). Not part of make gpu: no
# chapter reads it.
gpu-backward-stages:
	$(GPU_PYTHON) -m ssd.tools.backward_stages --head-splits 1,2,4,8 --block-q 32,64 --warps 4,8 \
	  --reps 30

# make gpu-smoke: each benchmark tool of make gpu once, on its smallest problem, into
# _build/gpu-smoke/: a tool that fails there would fail its part of a recording spread over
# several sessions. Not part of make gpu: it records nothing the book reads.
SMOKE ?= _build/gpu-smoke
gpu-smoke:
	$(GPU_PYTHON) -m ssd.tools.endtoend --only share --shapes 130m --reps 2 --chunk-size cutile=64 \
	  --out $(SMOKE)/endtoend.json
	$(GPU_PYTHON) -m ssd.tools.endtoend --only prefill --quick --layers 2 --prefill-reps 1 \
	  --chunk-size cutile=64 --out $(SMOKE)/endtoend.json
	$(GPU_PYTHON) -m ssd.tools.decode_bench --shapes 2.7b --reps 3 --out $(SMOKE)/decode.json
	$(GPU_PYTHON) -m ssd.tools.serving --layers 2 --reps 1 --chunk-size cutile=64 \
	  --out $(SMOKE)/serving_scenario.json
	$(GPU_PYTHON) -m ssd.tools.host_profile --reps 50 --out $(SMOKE)/host_profile.json
	$(GPU_PYTHON) -m ssd.tools.bench --suite robust --impl ssd --impl mamba_ssm --reps 3 \
	  --shard 1/30 --out $(SMOKE)/robust.json
	$(GPU_PYTHON) -m ssd.tools.backward_bench --shapes small-state --reps 3 \
	  --out $(SMOKE)/backward.json
	$(GPU_PYTHON) -m ssd.tools.train mqar --seed 0 --steps 20 --no-progress \
	  --out $(SMOKE)/training.json
	$(GPU_PYTHON) -m ssd.tools.train step --shapes 130m --layers 2 --reps 2 \
	  --chunk-size cutile=128 --no-progress --out $(SMOKE)/training_step.json

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
