#!/bin/bash
# Regenerate every evidence record from this tree, unattended (about 3 hours on 2 CPUs):
#   1. the benches, each at idle (1-minute load < 0.8 before it starts): the served MTP gates read their
#      acceptance floors from bench-deepseek_v4-mtp.json and glm_dsa/bench_mtp_quick.json, so these first;
#   2. every test on vLLM 0.32.0, the gates writing their records;
#   3. every gate on each older engine (nox -s compat).
# Then: rm -rf evidence/{corrupt,crashing,interrupted,misload}; write_index; `ascend-adapters evidence
# check evidence`; docs numbers from the records. Logs: $LOG (default /work/regen), one per step.
# Steps (default: provision benches tests compat): provision | benches | tests | compat | compat:<version>
set -u
cd "$(git rev-parse --show-toplevel)"
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG=${LOG:-/work/regen}
mkdir -p "$LOG" .nox/bench
PY=.nox/env-all/bin/python

wait_idle() {
    while ! awk '{exit !($1 < 0.8)}' /proc/loadavg; do sleep 15; done
    echo "load $(cat /proc/loadavg) at $(date +%T)"
}
bench() {
    wait_idle
    echo "== $* $(date +%T)"
    ASCEND_ADAPTERS_EVIDENCE_DIR= "$PY" "$@" --evidence-dir evidence
    echo "rc=$? $(date +%T)"
}
benches() {
    bench common/bench/bench_w8a8.py --out .nox/bench/bench_w8a8.json
    bench common/bench/bench_hashing.py --out .nox/bench/bench_hashing.json
    bench models/rwkv7/bench/bench_rwkv7.py --out .nox/bench/bench_rwkv7.json
    bench models/glm_dsa/bench/bench_glm_dsa.py --out .nox/bench/bench_glm_dsa.json
    bench models/glm_dsa/bench/bench_glm_dsa.py --only-mtp --quick --out .nox/bench/bench_glm_dsa_mtp_quick.json
    bench models/deepseek_v4/bench/bench_deepseek_v4.py --only-mtp
    bench models/deepseek_v4/bench/bench_deepseek_v4.py --skip-mtp --out .nox/bench/bench_deepseek_v4.json
    bench models/deepseek_v4/bench/bench_deepseek_v4.py --only-memory
    bench models/deepseek_v4/bench/bench_deepseek_v4.py --only-prefix
    # decode scaling (issue #46 item 7), one adapter at a time, each at idle: tiny then real width
    for m in rwkv7 glm_dsa deepseek_v4; do
        bench common/bench/bench_decode_scaling.py --model "$m" --out .nox/bench/bench_decode_scaling.json
    done
}
provision() { python3 -m nox -s lint && python3 -m nox -s gates -- --co -q; echo "provision rc=$? $(date +%T)"; }
tests() { ASCEND_ADAPTERS_EVIDENCE_DIR="$PWD/evidence" python3 -m nox -s gates -- -ra --durations=20; echo "tests rc=$? $(date +%T)"; }
compat() { ASCEND_ADAPTERS_EVIDENCE_DIR="$PWD/evidence" python3 -m nox -s compat -- "$@" -ra; echo "compat $* rc=$? $(date +%T)"; }

for step in "${@:-provision benches tests compat}"; do
    for s in $step; do
        case "$s" in
        compat:*) compat "${s#compat:}" > "$LOG/$s.log" 2>&1 ;;
        *) "$s" > "$LOG/$s.log" 2>&1 ;;
        esac
    done
done
