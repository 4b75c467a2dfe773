#!/usr/bin/env bash
# One call on the lent H200 machine: run the named stages, each under its own time limit, with
# logs and results under $OUT (or results/h200 elsewhere). The package runs from the checkout.
#
#   scripts/h200-run.sh gemm:120 suite:420      stage:seconds, in order
#
# stages: wgmma       build and run benchmarks/wgmma_check.cu: the solutions' wgmma GEMM checked against fp64
#                     and timed beside benchmarks/sgemm.cuh (WGMMA_ARGS adds flags, e.g. --mask 1)
#         gemm        the GEMM-family solutions at odd shapes (tests/gpu/test_gemm_solutions.py)
#         tests       the GPU test suite (scripts/test-gpu.sh; TEST_K selects with pytest -k)
#         suite       every shipped solution through `hpc eval-suite` at GPU scale (SUITE_ARGS adds flags)
#         profile     every harness request of serial evaluations, with and without prestarted
#                     processes (benchmarks/evaluation_profile.py; PROFILE_ARGS adds flags)
#         protocol    the outside clock's figure vs the same call timed in process, on spins of known length
#                     (benchmarks/outside_clock.py; PROTOCOL_ARGS adds flags)
#         cost        eval-suite wall time of this checkout vs a previous one in .previous/ (carried;
#                     benchmarks/protection_cost.py; COST_ARGS adds flags)
#         quality     timing spread over repeated evaluations and the eager-identical bias
#         throughput  candidates per minute of one process, cold and warm caches, level 1
#         pool        candidates per minute per GPU through the MPI pool (POOL_ARGS adds flags)
#         train       the trainer on the GPU at the 0.5B shape (configs/train/h200-smoke.yaml; needs megatron-core)
#         policy      the megatron policy: training tokens/s and MFU, rollout tokens/s vs HF generate
#                     (benchmarks/policy_speed.py at the 0.5b preset; POLICY_ARGS adds flags)
#         spread      why the torch.compile baseline moves: fresh compiles' code and figures
#                     (benchmarks/compile_spread.py; SPREAD_ARGS adds flags)
#         repeat      the suite evaluated three times from fresh caches, rewards and ratios per run
#                     (benchmarks/reward_repeat.py, records in repeat/; REPEAT_ARGS adds flags)
# A PYTHONPATH already set (packages installed with pip --target) stays after the checkout.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HPC_CACHE_DIR="${HPC_CACHE_DIR:-$root/.cache/hpc}"
out="${OUT:-$root/results/h200}"
mkdir -p "$out" "$HPC_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv >"$out/gpu.csv" 2>&1
date -u +%FT%TZ >>"$out/gpu.csv"

for spec in "$@"; do
    stage="${spec%%:*}"
    limit="${spec#*:}"
    [ "$limit" = "$spec" ] && limit=600
    echo "=== $stage (limit ${limit}s) $(date -u +%T)"
    case "$stage" in
        wgmma) cmd=(bash -c "mkdir -p build && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
                        -o build/wgmma_check benchmarks/wgmma_check.cu && build/wgmma_check ${WGMMA_ARGS:-}") ;;
        gemm) cmd=(python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm_solutions.py) ;;
        tests) cmd=(bash scripts/test-gpu.sh -q -rfE --durations=25)
               [ -n "${TEST_K:-}" ] && cmd+=(-k "$TEST_K") ;;
        suite) cmd=(python3 -m hpc.cli eval-suite kernels/tasks kernels/solutions --backend cuda --scale gpu
                    --out "$out/suite.h5" ${SUITE_ARGS:-}) ;;
        profile) cmd=(python3 benchmarks/evaluation_profile.py --backend cuda --out "$out/profile.json" ${PROFILE_ARGS:-}) ;;
        protocol) cmd=(python3 benchmarks/outside_clock.py --backend cuda --out "$out/protocol.json" ${PROTOCOL_ARGS:-}) ;;
        cost) cmd=(python3 benchmarks/protection_cost.py --previous .previous --backend cuda --out "$out/cost.json"
                   ${COST_ARGS:-}) ;;
        quality) cmd=(python3 benchmarks/timing_quality.py --backend cuda --out "$out/quality.json" ${QUALITY_ARGS:-}) ;;
        throughput) cmd=(python3 benchmarks/eval_throughput.py --backend cuda --only level1
                         --out "$out/throughput.json") ;;
        train) cmd=(python3 jobs/train.py --config configs/train/h200-smoke.yaml --out "$out/train") ;;
        pool) cmd=(python3 benchmarks/pool_throughput.py --backend cuda --only level1 --out "$out/pool.json"
                   --keep "$out/pool" ${POOL_ARGS:-}) ;;
        policy) cmd=(python3 benchmarks/policy_speed.py --device cuda --preset 0.5b --out "$out/policy.json"
                     ${POLICY_ARGS:-}) ;;
        spread) cmd=(python3 benchmarks/compile_spread.py --backend cuda --out "$out/spread.json" ${SPREAD_ARGS:-}) ;;
        repeat) cmd=(python3 benchmarks/reward_repeat.py --backend cuda --keep "$HPC_CACHE_DIR/repeat" ${REPEAT_ARGS:-}) ;;
        *) echo "unknown stage $stage"; exit 2 ;;
    esac
    if [ "$stage" = repeat ] && [[ " ${REPEAT_ARGS:-} " != *" --first "* ]]; then
        rm -rf "$HPC_CACHE_DIR/repeat"   # a warm machine's earlier runs are not this call's (unless --first adds to them)
    fi
    timeout "$limit" "${cmd[@]}" >"$out/$stage.log" 2>&1
    rc=$?
    if [ "$stage" = repeat ]; then   # the records alone: a call brings back 8 files, journals and locks would take places
        mkdir -p "$out/repeat" && cp "$HPC_CACHE_DIR"/repeat/run-*.h5 "$HPC_CACHE_DIR"/repeat/picks-*.json "$out/repeat/"
    fi
    tail -n 40 "$out/$stage.log"
    echo "=== $stage exit $rc $(date -u +%T)"
done
