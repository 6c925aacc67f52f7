#!/usr/bin/env bash
# One device call: install the carried FlashInfer wheels, run the GPU tests, then the offline benchmark and
# its ablations. Usage on the device: bash benchmark/device_run.sh [quick]; figures land in $OUT/bench.jsonl.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD/libs
fi
export PYTHONPATH=${PYTHONPATH:-}:$PWD/libs:$PWD
python3 -c "import kubesgl.services" 2>/dev/null || ln -sfn "$PWD/services" libs/kubesgl/services
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
B="python3 -m kubesgl.cli bench offline --json $OUT/bench.jsonl"
case "${1:-full}" in
  quick) $B --model Qwen3-0.6B --num-seqs 32 ;;
  a)
    $B --model Qwen3-0.6B --hf-baseline 32
    $B --model Qwen3-0.6B --disable-overlap
    ;;
  trace)  # kernel-level decode trace; an older tree to compare may be carried in .whl/old (git archive)
    T="python3 benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes 1,64,256 --context 800"
    timeout 200 $T --json "$OUT/trace.jsonl" 2>&1 | tee "$OUT/trace.txt"
    if [ -d .whl/old/libs ]; then
      PYTHONPATH=/tmp/site:$PWD/.whl/old/libs:$PWD/.whl/old timeout 150 $T --json "$OUT/trace_old.jsonl" \
        2>&1 | tee "$OUT/trace_old.txt"
    fi
    ;;
  b)
    $B --model Qwen3-14B
    $B --model Qwen3-0.6B --attn triton
    $B --model Qwen3-0.6B --cuda-graph-max-bs 0
    ;;
esac
