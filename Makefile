# Entry points: `make run` (install if needed, then the demo pipeline locally), `make test`, `make lint`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The venv's torch: the CPU build on this disk; the stand-in base image holds the same.
TORCH := 2.13.0
DEMO_RAW := build/demo_raw

.PHONY: install lock browser engine apt image image-base-torch run test lint bench bench-models gpu-check gpu-bundle figures screenshot clean

# torch goes in first, pinned to the CPU build on this disk: anything that pulled torch
# before it would drag in a multi-GB CUDA build. Then every other package at the version and
# hash requirements-dev.lock holds (the lock leaves torch out), the project itself, and pip's
# check that nothing pyproject.toml asks for is missing (a lock `make lock` has not remade).
$(STAMP): pyproject.toml requirements-dev.lock
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==$(TORCH)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements-dev.lock
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

# requirements.lock and requirements-dev.lock remade from pyproject.toml (tools/lock.py) after
# its ranges change; `make lock ARGS=--upgrade` takes the newest releases they admit.
lock: install
	$(PY) tools/lock.py $(ARGS)

# The demo: BBC News articles and a labels file staged as a user's raw data (once), then the
# whole pipeline on the local backend. Each call is a new run_num; nothing is overwritten.
run: install
	@test -d $(DEMO_RAW) || $(PY) -m user_functions.demo_data $(DEMO_RAW)
	$(PY) -m pipeline.cli upload settings.ini $(DEMO_RAW) --if-empty
	$(PY) run_pipeline.py settings.ini

# Debian's chromium, for the test that opens report.html in a real browser (playwright drives
# it; it downloads no browser of its own). Where it cannot be installed, `make test` stops
# here rather than skip that test; `.venv/bin/python -m pytest -m "not browser"` runs the rest.
browser:
	@command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| (echo "chromium could not be installed (apt-get as root): the report's browser test needs it;" \
		    "run the other tests with: .venv/bin/python -m pytest -m 'not browser'" >&2; exit 1)

# The container engine: docker where its daemon answers, podman otherwise (installed with apt
# as root, with runc, netavark and aardvark-dns for containers that find each other by name,
# and iptables for their networks; mmdebstrap comes when a stand-in base is built).
# docker/containers.conf becomes podman's settings where there are none.
ENGINE ?= $(shell if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; else echo podman; fi)
ENGINE := $(ENGINE)
IMAGE ?= smpipe:latest
# The real base (docker/Dockerfile's BASE), and the stand-in built where it cannot be pulled:
# Debian's Python 3.11 and the CPU torch the venv holds (docker/standin-base.sh). Its tag's
# -rN grows whenever standin-base.sh changes what the stand-in holds: a kept one is rebuilt.
REAL_BASE := pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
STANDIN_BASE := smpipe-standin-base:torch-$(TORCH)-r3
CA_BUNDLE ?= /etc/ssl/certs/ca-certificates.crt
# The image's platform: an engine on Apple Silicon pulls the arm64 variant of the base and
# builds arm64 unless told, and SageMaker's x86 instances (ml.m5, ml.g5, ml.p4d...) cannot run
# that image. `make image PLATFORM=linux/arm64` builds one for this machine only.
PLATFORM ?= linux/amd64

engine:
	@command -v $(ENGINE) >/dev/null || $(MAKE) --no-print-directory apt PACKAGES="podman runc iptables netavark aardvark-dns"
	@test "$(ENGINE)" != podman || test -e /etc/containers/containers.conf \
		|| install -D -m 644 docker/containers.conf /etc/containers/containers.conf

# Debian packages, as root: the lists are refreshed only when an install fails without.
apt:
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(PACKAGES) >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(PACKAGES) >/dev/null 2>&1) || \
		(echo "could not install $(PACKAGES) with apt-get (as root): install them, or docker, by hand" >&2; exit 1)

# The image every job runs in, tagged $(IMAGE): on the real base where the engine has it or can
# pull it, on the stand-in otherwise (built once, kept). `make image BASE=...` names another.
image: engine requirements.lock
	@base="$(BASE)"; \
	if [ -z "$$base" ]; then \
		if $(ENGINE) image exists $(REAL_BASE) 2>/dev/null || $(ENGINE) image inspect $(REAL_BASE) >/dev/null 2>&1 \
			|| timeout 1800 $(ENGINE) pull -q --platform $(PLATFORM) $(REAL_BASE) >/dev/null 2>&1; then base=$(REAL_BASE); \
		else \
			base=$(STANDIN_BASE); \
			echo "$(REAL_BASE) cannot be pulled here: building on the stand-in $$base (see README)"; \
			$(ENGINE) image inspect $$base >/dev/null 2>&1 || { \
				command -v mmdebstrap >/dev/null || $(MAKE) --no-print-directory apt PACKAGES=mmdebstrap; \
				wheel=$$(ls /opt/wheels/torch-$(TORCH)+cpu-cp311-*.whl 2>/dev/null | head -1); \
				if [ -z "$$wheel" ]; then mkdir -p build/wheels && python3 -m pip download -q --no-deps \
					--python-version 3.11 --only-binary=:all: --index-url https://download.pytorch.org/whl/cpu \
					-d build/wheels torch==$(TORCH)+cpu && wheel=$$(ls build/wheels/torch-$(TORCH)+cpu-*.whl); fi; \
				docker/standin-base.sh $(ENGINE) $$base $$wheel $(CA_BUNDLE); }; \
		fi; \
	fi; \
	secret=; test -s $(CA_BUNDLE) && secret="--secret id=ca,src=$(CA_BUNDLE)"; \
	$(ENGINE) build -q --platform $(PLATFORM) -f docker/Dockerfile --build-arg BASE=$$base $$secret -t $(IMAGE) . >/dev/null \
		&& echo "$(IMAGE) built on $$base"

# The real base's torch release on a stand-in: torch $(BASE_TORCH) from the package index (its
# CUDA build, which runs on a CPU, and the NVIDIA libraries it needs: about 3 GB, 7 GB
# installed) on the stand-in's Debian Python 3.11 (the real base's is 3.11 too), and the image
# built on it, tagged $(BASE_TORCH_IMAGE). make test runs the job tests that matter in it
# (tests/test_image.py, `base_torch`): a torch API steps/ uses that $(BASE_TORCH) lacks fails
# here, not on SageMaker. Built once, kept, as the other stand-in.
BASE_TORCH := 2.9.1
BASE_TORCH_STANDIN := smpipe-standin-base:torch-$(BASE_TORCH)-r3
BASE_TORCH_IMAGE ?= smpipe:torch-$(BASE_TORCH)
image-base-torch: engine requirements.lock
	@$(ENGINE) image inspect $(BASE_TORCH_STANDIN) >/dev/null 2>&1 || { \
		command -v mmdebstrap >/dev/null || $(MAKE) --no-print-directory apt PACKAGES=mmdebstrap; \
		wheel=$$(ls build/wheels/torch-$(BASE_TORCH)-cp311-*manylinux*x86_64.whl 2>/dev/null | head -1); \
		if [ -z "$$wheel" ]; then mkdir -p build/wheels && python3 -m pip download -q --no-deps \
			--python-version 3.11 --only-binary=:all: --platform manylinux_2_28_x86_64 \
			-d build/wheels torch==$(BASE_TORCH) && wheel=$$(ls build/wheels/torch-$(BASE_TORCH)-cp311-*.whl); fi; \
		docker/standin-base.sh $(ENGINE) $(BASE_TORCH_STANDIN) $$wheel $(CA_BUNDLE); }
	@secret=; test -s $(CA_BUNDLE) && secret="--secret id=ca,src=$(CA_BUNDLE)"; \
	$(ENGINE) build -q --platform $(PLATFORM) -f docker/Dockerfile --build-arg BASE=$(BASE_TORCH_STANDIN) $$secret \
		-t $(BASE_TORCH_IMAGE) . >/dev/null && echo "$(BASE_TORCH_IMAGE) built on $(BASE_TORCH_STANDIN)"

test: install browser image image-base-torch
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

# Speed against the Trainer, transformers' pipeline and datasets.map (bench/results.json), with
# the training loader's rows/s beside the loop's; the loader alone against the row-by-row
# collate it replaced; the training loop's cost a step against the Trainer's, on a tiny model;
# what checkpointing costs, then what a tuning trial spends outside its steps and what a
# completed run keeps (bench/run_cost.json), what metering a local job costs its machine, and
# what warm start saves a check of the user functions and a job of two processes.
# Each prints its table; none asserts a time.
bench: install
	$(PY) bench/speed.py
	$(PY) bench/loader.py
	$(PY) bench/loop_overhead.py
	$(PY) bench/checkpoint_cost.py
	$(PY) bench/run_cost.py
	$(PY) bench/metering.py
	$(PY) bench/warm_start.py

# Finetuning larger models (about 40 minutes on 2 cores): a 1B decoder with LoRA and gradient
# checkpointing against full finetuning and the Trainer with a PEFT model
# (bench/large_models.json), LoRA beside full finetuning on MiniLM over three seeds
# (bench/lora_quality.json), then FSDP beside DDP: a BERT-large-sized model's memory per
# process, and MiniLM over three seeds (bench/fsdp.json). Each prints its table; none asserts
# a figure.
bench-models: install
	$(PY) bench/large_models.py
	$(PY) bench/lora_quality.py
	$(PY) bench/fsdp.py

# The GPU path on this machine's GPUs, through the real jobs (bench/gpu_check.py): bf16
# training and its MFU, our training loop against the Trainer (bench/gpu_speed.py), two
# processes on NCCL, loader workers with pinned memory, SIGTERM and resume, COMPILE, LoRA with
# gradient checkpointing (merged, exported, its adapter), FSDP, bf16 inference and predict.
# Prints a table; exits 1 if a check failed.
gpu-check: install
	$(PY) bench/gpu_check.py

# What a GPU machine without network needs beside the repository to run the GPU checks:
# build/gpu-bundle (bench/gpu_bundle.sh). There, `bash bench/gpu_run.sh` unpacks it and
# measures (docs/performance.md, "On a lent GPU machine without network").
gpu-bundle: install
	bash bench/gpu_bundle.sh

# The "Runs you can trust" table of docs/trust.md, made from what its tests count as they run
# (build/figures/, tests/reliability/figures.py): those tests, then the table written over
# the page's (nothing is written while a figure is missing). The demo's figures come from a
# run: `$(PY) docs/figures.py demo settings.ini` after `make run`.
figures: install
	$(PY) -m pytest -q tests/reliability tests/test_cache_mutations.py tests/test_local_backend.py
	$(PY) docs/figures.py reliability --write docs/trust.md

# docs/report.png: the newest demo run's report.html as a browser shows it (run `make run` first).
screenshot: install browser
	$(PY) docs/screenshot.py settings.ini docs/report.png

clean:
	rm -rf build artifacts
