#!/usr/bin/env bash
# One device call: install the carried FlashInfer wheels, run the GPU tests, then the offline benchmark and
# its ablations. Usage on the device: bash benchmark/device_run.sh [quick]; figures land in $OUT/bench.jsonl.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# A FlashInfer JIT cache from an earlier call (tar czf fi-jit.tgz -C $HOME .cache/flashinfer) saves ~2 min.
[ -f .whl/fi-jit.tgz ] && tar xzf .whl/fi-jit.tgz -C "$HOME"
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
  trace)  # kernel-level traces: decode at bs 1/64/256 and one 8k-token prefill; then the Triton-decode hybrid
    T="python3 benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes 1,64,256 --context 800"
    timeout 200 $T --prefill-tokens 8192 --json "$OUT/trace.jsonl" 2>&1 | grep -v Warn | tee "$OUT/trace.txt"
    timeout 150 $T --attn flashinfer,triton --top 12 --json "$OUT/trace_hybrid.jsonl" 2>&1 | grep -v Warn \
      | tee "$OUT/trace_hybrid.txt"
    ;;
  final)  # GPU tests, then the offline figures in priority order (each bounded; $OUT keeps what finished)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backends.py tests/test_kernels.py \
      tests/test_runner_fastpath.py tests/test_gpu_parity.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
    P="env KUBESGL_STEP_PROFILE=1 timeout 90 $B"
    $P --model Qwen3-0.6B --attn flashinfer 2>&1 | tail -14 | tee "$OUT/p_flashinfer.txt"
    $P --model Qwen3-0.6B --attn flashinfer,triton 2>&1 | tail -14 | tee "$OUT/p_hybrid.txt"
    timeout 150 $B --model Qwen3-14B | tail -1
    timeout 90 $B --model Qwen3-0.6B --disable-overlap | tail -1
    timeout 90 $B --model Qwen3-0.6B --attn triton | tail -1
    timeout 90 $B --model Qwen3-0.6B --cuda-graph-max-bs 0 | tail -1
    ;;
  b)
    $B --model Qwen3-14B
    $B --model Qwen3-0.6B --attn triton
    $B --model Qwen3-0.6B --cuda-graph-max-bs 0
    ;;
esac
