SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# Each contract is generated into the source root of the component that owns it.
PROTO_ROOTS := engine:services/engine journal:services/journal inputs:services/inputs

.PHONY: help setup debian dev test docs docs-serve lint breaking fmt proto proto-check bench bench-state bench-parallel bench-scale bench-replicas bench-pair bench-peers jetstream-facts test-guards test-chaos clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The Node.js worker example (tests/test_node_worker.py runs it).
NODE_WORKER := examples/node-worker
$(NODE_WORKER)/node_modules/.installed: $(NODE_WORKER)/package.json $(NODE_WORKER)/package-lock.json
	npm ci --prefix $(NODE_WORKER) --no-audit --no-fund
	touch $@

# Debian's packages the tests use: chromium, which the console's browser
# tests (tests/test_console.py) drive through Playwright (nothing is
# downloaded at test time), and valgrind, whose callgrind counts instructions
# for make bench-replicas (tests/test_bench_replicas.py). Installed here when
# missing and we are root; otherwise the tests fail saying how to install them.
DEBIAN_PACKAGES := chromium valgrind
debian:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do command -v $$p >/dev/null || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing:" $$missing "- the tests need them (apt-get install" $$missing", as root)" >&2; \
	  fi; \
	fi

setup: $(VENV)/.installed $(NODE_WORKER)/node_modules/.installed debian ## create the virtualenv and install everything

dev: setup ## run nats-server, the services and a demo agent (Ctrl-C stops)
	$(BIN)/dagnats dev

# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole
# modules (--dist loadfile), so a module's fixtures -- its nats-server, its
# services, its browser -- are still started once, and one module's waits
# (leases running out, restarts) overlap another's work: three processes on
# two cores, as the suite waits more than it computes (ADR 72).
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 3
test: setup ## run the test suite against a real nats-server (TEST_WORKERS processes, 3)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The documentation site (mkdocs.yml, docs/): the reference pages are generated
# from the code as it builds; --strict fails on a broken link or a warning.
DOCS_ADDR := 127.0.0.1:8000
export NO_MKDOCS_2_WARNING := 1
docs: setup ## build the documentation site into site/ (strict: a broken link fails)
	$(BIN)/mkdocs build --strict

docs-serve: setup ## serve the documentation at http://127.0.0.1:8000, rebuilt on each change
	$(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

lint: setup proto-check ## ruff, mypy (--strict on the code, relaxed on tests), buf lint, format and breaking
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy tests bench
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	$(MAKE) --no-print-directory breaking

# buf breaking guards the contracts a release has shipped: it compares with the
# newest release tag (v*), fetching the tags first in a clone that has none.
# Before the first release no client holds a contract, so they change freely
# and it compares nothing (docs/adr/0063-one-name-per-concept.md).
RELEASE_TAGS := v*
breaking: setup ## buf breaking: no change to the contracts that breaks a released client
	@if [ -z "$$(git tag --list '$(RELEASE_TAGS)')" ] && git remote get-url origin >/dev/null 2>&1; then \
	  git fetch -q --tags origin || { echo "cannot fetch the release tags from origin" >&2; exit 1; }; \
	fi; \
	release=$$(git tag --list '$(RELEASE_TAGS)' --sort=-version:refname | head -n 1); \
	if [ -z "$$release" ]; then \
	  echo "buf breaking: no release tag ($(RELEASE_TAGS)) yet, so no released contract to compare with"; \
	  exit 0; \
	fi; \
	echo "buf breaking --against .git#ref=$$release"; \
	$(BIN)/buf breaking --against ".git#ref=$$release"

fmt: setup ## format the code and the contracts
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/buf format -w

proto: setup ## regenerate Python code and typed stubs from proto/
	@for pair in $(PROTO_ROOTS); do \
	  name=$${pair%%:*}; out=$${pair#*:}; \
	  PATH="$(CURDIR)/$(BIN):$$PATH" $(PY) -m grpc_tools.protoc -I proto \
	    --python_out=$$out --grpc_python_out=$$out \
	    --mypy_out=$$out --mypy_grpc_out=$$out \
	    proto/dagnats/$$name/v1/*.proto; \
	done

proto-check: proto ## fail when the generated code is stale
	@git diff --exit-code --stat -- '*_pb2.py' '*_pb2.pyi' '*_pb2_grpc.py' '*_pb2_grpc.pyi' \
	  || { echo "generated code is stale: run 'make proto' and commit" >&2; exit 1; }

bench: setup ## journal overhead and the agent-turn workload against raw JetStream; streams; waits; cancels
	$(PY) -m bench.journal_overhead
	$(PY) -m bench.bench_stream
	$(PY) -m bench.bench_wait
	$(PY) -m bench.bench_cancel
	$(PY) -m bench.bench_turn
	BENCH_DEPLOY=grpc $(PY) -m bench.bench_turn
	BENCH_DEPLOY=services $(PY) -m bench.bench_turn
	BENCH_DEPLOY=split $(PY) -m bench.bench_turn
	$(PY) -m bench.bench_state
	$(PY) -m bench.bench_parallel

bench-state: setup ## a conversation growing 20 KB a turn for 1,000 turns: turn time and journal bytes
	$(PY) -m bench.bench_state

bench-parallel: setup ## five 200 ms tools of one response: a parallel group against one at a time
	$(PY) -m bench.bench_parallel

# BENCH_WAITERS (10,000), BENCH_WAKES, BENCH_LONG_K, BENCH_CLUSTER=0... scale it down.
bench-scale: setup ## 10,000 waiting runs, wake latency, iteration 1,000, two engines, R3 cluster
	$(PY) -m bench.bench_scale

# BENCH_TOPOLOGIES (server,cluster), BENCH_REPLICAS (1,2,3), BENCH_PARTITIONS (6), BENCH_K,
# BENCH_C, BENCH_ROUNDS, BENCH_KILLS (0: no failover), BENCH_ACK_WAIT, BENCH_INSTRUCTIONS (0: not
# counted), BENCH_KINDS=1 (messages by kind); JSON=<path> keeps the record.
bench-replicas: setup ## 1, 2 and 3 replicas, one server and an R3 cluster: throughput, cost an iteration, failover
	$(PY) -m bench.bench_replicas $(if $(JSON),--json $(JSON))

bench-pair: setup ## this checkout beside BASE=<another checkout>, runs alternated (seq, thr, K=1)
	@test -n "$(BASE)" || { echo 'usage: make bench-pair BASE=<another checkout>'; exit 2; }
	$(PY) -m bench.bench_pair $(BASE)

# PASSES (3), SETTLE_LOAD (0.6), BENCH_OUT; the peers' BENCH_* knobs shorten it.
bench-peers: setup ## the peers and dagnats' four deployments, passes interleaved: PEERS=<the peer benchmarks>
	@test -n "$(PEERS)" || { echo 'usage: make bench-peers PEERS=<a checkout of the peer benchmarks>'; exit 2; }
	bash bench/beside_peers.sh $(PEERS)

jetstream-facts: setup ## the JetStream facts the design depends on (R1 and R3), and fsyncs per operation (strace)
	$(BIN)/pytest -q tests/test_jetstream_facts.py
	$(PY) -m bench.jetstream_fsyncs

test-guards: setup ## delete each safety guard in a scratch copy; a named test must fail
	$(PY) -m tests.guards

# SEED=n replays a schedule; CHAOS_SECONDS (300) and CHAOS_TOPOLOGY (server, cluster, both).
test-chaos: setup ## fault-injection soak, 3 replicas (SEED=n replays, CHAOS_SECONDS, CHAOS_TOPOLOGY); 10,000 waits
	CHAOS_SEED="$(SEED)" CHAOS_SECONDS="$(or $(CHAOS_SECONDS),300)" \
	  CHAOS_TOPOLOGY="$(or $(CHAOS_TOPOLOGY),both)" $(BIN)/pytest -q -s -m chaos tests/chaos
	DAGNATS_TEST_WAITS=10000 $(BIN)/pytest -q tests/test_many_waits.py

clean: ## remove the virtualenv and local data
	rm -rf $(VENV) .dagnats
