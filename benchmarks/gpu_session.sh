#!/usr/bin/env bash
# The checks a lent GPU gets, prepared once so that a session's few minutes of device time go
# to running them: each PART writes $OUT/PART.txt (and the profile's traces under $OUT/traces)
# and is stopped at its own time limit, so one hang cannot take the whole budget.
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh env profile tests      # one call of the machine
#   OUT=/some/folder bash benchmarks/gpu_session.sh rows sharded startup   # the next
#   OUT=/tmp/check GPU_SESSION_DEVICE=cpu bash benchmarks/gpu_session.sh profile rows sharded startup   # on a CPU
#
# Parts (seconds they were given; the device's start comes on top):
#   env      the GPU, driver, torch, CUDA, NCCL, cores, and what imports (10)
#   tests    pytest -m gpu tests/test_gpu.py (300)
#   profile  GPT-2 steps 30-39 on both sides, fp32 and bf16-mixed: the summary, the CUDA
#            synchronisations each side made, the traces compared per step (240)
#   rows     GPT-2 and ResNet-50 against the plain loop, fp32 and bf16-mixed, one round (400)
#   sharded  GPT-2 on 2 and 3 workers sharing the GPU, optimizer state sharded against whole (240)
#   startup  GPT-2: building the model to the first committed step against the plain loop (200)
# benchmarks/README.md ("GPU") keeps what they printed; docs/architecture.md says what they check.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_USAGE_STATS_ENABLED=0
DEVICE=${GPU_SESSION_DEVICE:-cuda}
BENCH=(python benchmarks/bench_gpu.py --device "$DEVICE")
if [ "$DEVICE" = cpu ]; then BENCH+=(--small); fi

part() {  # name, seconds, command...
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "rc=$rc after $((SECONDS - began)) s" >>"$OUT/$name.txt"
    tail -n 60 "$OUT/$name.txt"
}

for name in "$@"; do
    case $name in
        env) part env 10 bash -c 'nvidia-smi || true; nproc; python - <<"EOF"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())
for module in ("cloudpickle", "numpy", "psutil", "transformers", "peft", "onnxruntime", "pytest", "fabric_model"):
    try:
        importlib.import_module(module)
        print(module, "imports")
    except Exception as exc:
        print(module, "does not import:", exc)
EOF' ;;
        tests) part tests 300 python -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider ;;
        profile) part profile 240 "${BENCH[@]}" --rows profile --rounds 1 --steps 100 --out "$OUT/traces" ;;
        rows) part rows 400 "${BENCH[@]}" --rows gpt2,resnet50 --rounds 1 --steps 100 ;;
        sharded) part sharded 240 "${BENCH[@]}" --rows sharded --rounds 1 --steps 100 ;;
        startup) part startup 200 "${BENCH[@]}" --rows startup --rounds 1 ;;
        *) echo "unknown part $name (env, tests, profile, rows, sharded, startup)" >&2; exit 2 ;;
    esac
done
echo "results in $OUT"
