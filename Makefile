# Both entry points install what they need first (scripts/setup.sh is idempotent).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two pytest-xdist workers (tests/conftest.py: the host's network and BPF tests run on one, one
# at a time, first; the rest spreads over both). PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2

.PHONY: setup demo test lint format faults faults-soak typecheck proto lock bench-classifier clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/adaptermesh demo

# Style, types and the import contracts first (ruff check, ruff format --check, mypy strict,
# import-linter): a finding fails the run like a failing test (`make format` lays files out).
# The tests run in a shuffled order (inside each directory; tests/conftest.py): the seed is
# in the header, and TEST_ORDER_SEED=<seed> make test repeats it, on two workers.
test: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not gpu" --order shuffle -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format src tests bench

# The fault-injection suite in full on the local mesh (docs/faults.md; root): a worker kill
# every 20 s for 3 minutes, three drains, an engine step error, the adapter store stalled, the
# control plane down, the agent restarted. `make test` runs its short form.
faults: setup
	$(PY) bench/bench_faults.py --out bench/results/faults_cpu.json

# The 30-minute soak (root; not in CI): mixed traffic, an override, pin or rollout changing every
# minute, RSS and descriptors of every process. SOAK_MINUTES=10 make faults-soak for less.
SOAK_MINUTES ?= 30
faults-soak: setup
	$(PY) bench/bench_faults.py --soak --soak-minutes $(SOAK_MINUTES) \
		--out bench/results/faults_soak_cpu.json

# The generated gRPC modules, made by the locked grpcio-tools (tests/test_lock.py checks the
# committed ones name its release).
proto: setup
	$(PY) -m adaptermesh.proto.generate

# Resolve every environment's lock in requirements/ again from pyproject.toml's ranges
# (scripts/lock.py). The periodic refresh: `make lock && make proto && make test`, then one
# commit. `$(PY) scripts/lock.py --check` says whether a refresh would change anything.
lock: setup
	$(PY) scripts/lock.py

bench-classifier: setup
	$(PY) bench/bench_classifier.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
