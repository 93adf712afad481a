# Entry points: `make run` (install if needed, then the demo pipeline locally), `make test`, `make lint`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_RAW := build/demo_raw

.PHONY: install browser run test lint bench gpu-check figures screenshot clean

# torch goes in first, pinned to the CPU build on this disk: anything that pulled torch
# before it would drag in a multi-GB CUDA build. The project's ranges (pyproject.toml) then
# accept the torch that is there and install nothing more for it.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

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

test: install browser
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

# Speed against the Trainer, transformers' pipeline and datasets.map (bench/results.json),
# what checkpointing costs, then what a tuning trial spends outside its steps and what a
# completed run keeps (bench/run_cost.json). Each prints its table; none asserts a time.
bench: install
	$(PY) bench/speed.py
	$(PY) bench/checkpoint_cost.py
	$(PY) bench/run_cost.py

# The GPU path on this machine's GPUs, through the real jobs (bench/gpu_check.py): bf16
# training and its MFU, two processes on NCCL, loader workers with pinned memory, SIGTERM and
# resume, COMPILE, bf16 inference and predict. Prints a table; exits 1 if a check failed.
gpu-check: install
	$(PY) bench/gpu_check.py

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
