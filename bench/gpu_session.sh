#!/usr/bin/env bash
# One GPU call, several stages, each under its own timeout, results and logs in $OUT:
#   tests     gpu-marked kernel tests (and worker tests with TESTS_WORKER=1), via bench/gpu_tests.py
#   sweep     bench/sweep_sgmm_decode.py (add_lora configs on the engine's shapes)
#   peers     bench/bench_sgmm_peers.py (our kernels beside the peers; needs bench/.peers)
#   int4      bench/sweep_sgmm_int4.py (INT4 shrink / expand configs beside the bf16 defaults)
#   adafuse   bench/bench_adafuse.py
#   engine    bench/bench_engine_speed.py (ENGINE_ARGS, e.g. "--only batch1,batch64,step_split")
#   fidelity  bench/fidelity_gpu.py (the model/adapter fidelity suite with the Triton kernels)
#   evict     bench/bench_eviction.py --device cuda --shape llama7b
#   http      bench/bench_service.py --mix
#   structured  bench/bench_structured_outputs.py --device cuda (batch 64, a JSON schema per row
#             against unconstrained; needs the llguidance and jsonschema wheels carried, with
#             referencing, rpds-py and jsonschema-specifications)
#   many_adapters  bench/bench_many_adapters.py (MANY_ADAPTERS_ARGS, e.g. "--rows r512_all,r2000_512";
#             model and adapters kept in MANY_ADAPTERS_WORK for the next call; MANY_ADAPTERS_OUT)
# STAGES picks them in order (default: all but fidelity, evict and many_adapters); <STAGE>_S overrides a
# stage's timeout; TESTS_PATHS and TESTS_OUT narrow the tests stage.
#   STAGES="tests sweep engine" ENGINE_ARGS="--only batch1,batch64" bench/gpu_session.sh
# The worker service imports pydantic and opentelemetry, which the GPU image lacked on
# 2026-12-03: carry their wheels (pydantic, pydantic_core, annotated-types, typing-inspection,
# opentelemetry-api/-sdk/-proto/-exporter-otlp-proto-common/-semantic-conventions) in an
# ignored .whl folder, install them with pip --target /tmp/site and put that on PYTHONPATH
# before calling this script (it appends to PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 REQUIRE_GPU=1
STAGES=${STAGES:-tests sweep peers adafuse engine http}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  git rev-parse HEAD 2>/dev/null
} > "$OUT/env.txt" 2>&1
stage() {  # name default_timeout command...
  local name=$1 t=$2
  shift 2
  local var="${name^^}_S"
  t=${!var:-$t}
  local t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 ))s (timeout ${t}s)"
  grep -E "passed|failed|Error|CASE|PICK|TARGET|target|met" "$OUT/$name.log" | tail -${TAIL:-40}
}
for s in $STAGES; do
  case $s in
    tests)
      paths=${TESTS_PATHS:-tests/kernels}
      [ -n "${TESTS_WORKER:-}" ] && paths="$paths tests/worker/test_gpu.py tests/worker/test_sampling.py tests/worker/test_structured_engine.py"
      stage tests 150 python3 bench/gpu_tests.py --out "$OUT/${TESTS_OUT:-gpu_tests_h200.json}" \
        --timeout-s $(( ${TESTS_S:-150} - 10 )) -- -m gpu $paths ;;
    sweep)
      stage sweep 240 python3 bench/sweep_sgmm_decode.py --out "$OUT/sgmm_decode_sweep_h200.json" \
        --budget-s $(( ${SWEEP_S:-240} - 25 )) ${SWEEP_ARGS:-} ;;
    peers)
      stage peers 260 python3 bench/bench_sgmm_peers.py --out "$OUT/sgmm_peers_h200.json" \
        --budget-s $(( ${PEERS_S:-260} - 20 )) ${PEERS_ARGS:-} ;;
    int4)
      stage int4 170 python3 bench/sweep_sgmm_int4.py --out "$OUT/sgmm_int4_sweep_h200.json" \
        --budget-s $(( ${INT4_S:-170} - 30 )) ;;
    adafuse)
      stage adafuse 160 python3 bench/bench_adafuse.py --out "$OUT/adafuse_h200.json" ;;
    engine)
      stage engine 300 python3 bench/bench_engine_speed.py --out "$OUT/${ENGINE_OUT:-engine_speed_h200.json}" \
        --budget-s $(( ${ENGINE_S:-300} - 15 )) ${ENGINE_ARGS:-} ;;
    fidelity)
      stage fidelity 170 python3 bench/fidelity_gpu.py --device cuda \
        --out "$OUT/fidelity_h200.json" --timeout-s $(( ${FIDELITY_S:-170} - 15 )) ${FIDELITY_ARGS:-} ;;
    evict)
      stage evict 120 python3 bench/bench_eviction.py --device cuda --shape llama7b \
        --out "$OUT/eviction_h200.json" ${EVICT_ARGS:-} ;;
    http)
      stage http 200 python3 bench/bench_service.py --mix --device cuda \
        --out "$OUT/engine_speed_h200_http.json" ${HTTP_ARGS:-} ;;
    structured)
      stage structured 330 python3 bench/bench_structured_outputs.py --device cuda \
        --out "$OUT/${STRUCTURED_OUT:-structured_outputs_h200.json}" ${STRUCTURED_ARGS:-} ;;
    many_adapters)
      stage many_adapters 560 python3 bench/bench_many_adapters.py --device cuda \
        --out "$OUT/${MANY_ADAPTERS_OUT:-many_adapters_h200.json}" \
        --work-dir "${MANY_ADAPTERS_WORK:-/tmp/many_adapters}" \
        --budget-s $(( ${MANY_ADAPTERS_S:-560} - 40 )) ${MANY_ADAPTERS_ARGS:-} ;;
  esac
done
