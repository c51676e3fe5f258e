#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-perplexity and llama-tokenize from the sources inside the
# llama-cpp-python sdist on PyPI (no GitHub access needed), for benchmarks/llama_server_peer.py and
# benchmarks/gguf_perplexity.py. ~10 min on 2 cores. Usage: benchmarks/peers/build_llama_cpp.sh [DIR]
# (default ~/.cache/tokenfleet/llama.cpp); prints the folder of the binaries.
set -euo pipefail
VERSION=0.3.36
DIR=${1:-$HOME/.cache/tokenfleet/llama.cpp}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  python3 -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d . >&2
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$SRC/build" -j"$(nproc)" --target llama-server llama-perplexity llama-tokenize >&2
echo "$SRC/build/bin"
