#!/usr/bin/env bash
# `make bench-peers PEERS=<dir>`: the agent-turn workload on the peers (Restate,
# raw JetStream, DBOS on SQLite) and on dagnats' four deployments (the
# services in one process, three ways to run the handler; the services apart
# as docker-compose runs them, BENCH_DEPLOY=split), in
# PASSES interleaved passes (3), the order turned each pass so that no
# system always runs first after another's, each run started once the
# machine's 1-minute load is under SETTLE_LOAD (0.6; at most SETTLE_MAX
# seconds of waiting, 240). PEERS is a checkout of the peer benchmarks
# (run_all.sh, bench_*.py, summarize.py); their run_all.sh installs what they
# need. Every record goes to BENCH_OUT (a new folder under /tmp by default),
# and the tables side by side to its summary.md.
set -euo pipefail
[ -d "${1:-}" ] || { echo "usage: beside_peers.sh <the peer benchmarks' folder>; got '${1:-}'" >&2; exit 2; }
PEERS=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
PASSES=${PASSES:-3}
SETTLE_LOAD=${SETTLE_LOAD:-0.6}
SETTLE_MAX=${SETTLE_MAX:-240}
export PEERS_VENV=${PEERS_VENV:-/tmp/peers-venv}
for f in run_all.sh bench_restate.py bench_nats.py bench_dbos.py summarize.py; do
  [ -f "$PEERS/$f" ] || { echo "$PEERS has no $f: not the peer benchmarks" >&2; exit 2; }
done
case $PASSES in '' | *[!0-9]* | 0) echo "PASSES must be a whole number from 1, got '$PASSES'" >&2; exit 2 ;; esac
case $SETTLE_MAX in '' | *[!0-9]*) echo "SETTLE_MAX must be whole seconds, got '$SETTLE_MAX'" >&2; exit 2 ;; esac
[[ $SETTLE_LOAD =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "SETTLE_LOAD must be a load such as 0.6, got '$SETTLE_LOAD'" >&2; exit 2; }
export BENCH_OUT=${BENCH_OUT:-$(mktemp -d /tmp/dagnats-beside-peers.XXXXXX)}
LOGS=$BENCH_OUT/logs
mkdir -p "$LOGS"

say() { echo "[$(date -u +%T)] $*" | tee -a "$LOGS/timeline"; }

settle() {
  local waited=0
  while awk -v at="$SETTLE_LOAD" '{exit !($1 >= at)}' /proc/loadavg && [ "$waited" -lt "$SETTLE_MAX" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  say "  load $(cut -d' ' -f1 /proc/loadavg) after ${waited}s of waiting"
}

one() {  # one system's run in pass $pass
  local system=$1 log=$LOGS/$1-pass$pass.log
  say "pass $pass/$PASSES: $system"
  settle
  local py=$PEERS_VENV/bin/python
  case $system in
    restate) BENCH_PASS=$pass "$py" "$PEERS/bench_restate.py" default --strace ;;
    nats-always) BENCH_PASS=$pass "$py" "$PEERS/bench_nats.py" always --strace ;;
    dbos-sqlite) BENCH_PASS=$pass "$py" "$PEERS/bench_dbos.py" sqlite --strace ;;
    dagnats-*) (cd "$HERE" && BENCH_PASS=$pass BENCH_DEPLOY=${system#dagnats-} \
      .venv/bin/python -m bench.bench_turn) ;;
  esac >"$log" 2>&1 || say "  $system failed: see $log"
}

say "installing the peers (run_all.sh's setup); records in $BENCH_OUT"
(cd "$PEERS" && PASSES=0 bash run_all.sh) >"$LOGS/setup.log" 2>&1 \
  || { echo "the peers' setup failed: see $LOGS/setup.log" >&2; exit 1; }
# The peers' knobs and their defaults (README there); dagnats' BENCH_RUNS follows BENCH_SEQ_RUNS.
export BENCH_SEQ_RUNS=${BENCH_SEQ_RUNS:-20} BENCH_WARMUP=${BENCH_WARMUP:-3}
export BENCH_START_RUNS=${BENCH_START_RUNS:-50} BENCH_THR_ROUNDS=${BENCH_THR_ROUNDS:-5}
export BENCH_K=${BENCH_K:-50} BENCH_C=${BENCH_C:-20} BENCH_RUNS=${BENCH_SEQ_RUNS}
systems=(restate dagnats-worker nats-always dagnats-grpc dbos-sqlite dagnats-services dagnats-split)
for pass in $(seq 1 "$PASSES"); do
  k=$(((pass - 1) % ${#systems[@]}))
  order=("${systems[@]:k}" "${systems[@]:0:k}")  # turned one place a pass
  for system in "${order[@]}"; do
    one "$system"
  done
done
"$PEERS_VENV/bin/python" "$PEERS/summarize.py" "$BENCH_OUT" >"$BENCH_OUT/summary.md"
say "the tables side by side: $BENCH_OUT/summary.md"
