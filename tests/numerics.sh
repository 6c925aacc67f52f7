#!/usr/bin/env bash
# `make test-numerics`: the tests that compare floats, under CPU settings unlike this machine's, twice each:
# ATen's vector width capped (ATEN_CPU_CAPABILITY), MKL's and oneDNN's too (their GEMMs are the sums that
# differ), and one or two threads. A tolerance that held only by one CPU's rounding fails here.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
files=(
  tests/unit/kernels/test_kernels.py tests/unit/kernels/test_layers_fastpath.py
  tests/unit/kernels/test_attention_backends.py tests/unit/models/test_models_parity.py
  tests/unit/models/test_models_tp.py tests/unit/engine/test_prompt_logprobs.py
  tests/unit/engine/test_engine_behaviour.py tests/unit/engine/test_mixed_chunk.py
  tests/unit/engine/test_batch_numerics.py tests/unit/engine/test_engine_parity.py
  tests/unit/engine/test_disaggregation.py tests/unit/engine/test_piecewise_graph.py tests/unit/kernels/test_gemv.py
  tests/unit/kernels/test_skinny_gemm.py
  tests/e2e/test_lm_eval.py tests/e2e/test_gateway_e2e.py
)
settings=(
  "ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41"
  "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
  "OMP_NUM_THREADS=1"
  "OMP_NUM_THREADS=2"
)
failed=0
for s in "${settings[@]}"; do
  for run in 1 2; do
    start=$(date +%s)
    out=$(env $s TRITON_INTERPRET=1 .venv/bin/python -m pytest -n 2 --dist loadfile -q -p no:cacheprovider \
      "${files[@]}" "$@" 2>&1)
    rc=$?
    echo "numerics: [$s] run $run: $(tail -n 1 <<<"$out") (exit $rc, $(($(date +%s) - start)) s)"
    if [ "$rc" != 0 ]; then
      failed=1
      grep -E "^(FAILED|ERROR)|Error" <<<"$out" | head -20
    fi
  done
done
exit "$failed"
