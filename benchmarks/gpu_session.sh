#!/usr/bin/env bash
# One prepared pass over everything that needs a GPU: the `gpu` tests, then the MFU / tokens-per-second
# and cost-model benchmarks. Each step has its own time limit so that one slow step cannot eat the rest;
# every log and JSON lands in $OUT (default ./gpu_out). Run from the repository root on a CUDA machine:
#
#     bash benchmarks/gpu_session.sh
#
# PYTHONPATH is set to the checkout, so the project need not be installed (its dependencies must be).
set -uo pipefail
out="${OUT:-./gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'EOF' | tee "$out/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
EOF
step() {  # step NAME SECONDS COMMAND...: run, keep its output, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log"
}
step gpu_tests "${GPU_TESTS_S:-200}" python3 -m pytest -q -m gpu tests/gpu -o addopts="-ra" -p no:cacheprovider
step overhead_llama1b "${OVERHEAD_S:-240}" python3 benchmarks/overhead.py --model llama1b --batch 4 --seq 2048 --steps 20 --warmup 5
step cost_model_gpu "${COST_MODEL_S:-150}" python3 benchmarks/cost_model_gpu.py --seqs 2048,8192 --layers 2
