#!/usr/bin/env bash
# Builds llama.cpp's Python bindings and server (llama-cpp-python, from its PyPI sdist) into a
# virtual environment outside the repository, for benchmarks/compare.py. The sdist also ships
# llama.cpp's own HF -> GGUF converter and its gguf-py, which compare.py uses to convert the
# random checkpoints. Takes many minutes on a small machine; run it early, e.g.
#     nice -n 19 benchmarks/build_llama_cpp.sh
# Environment: LLAMA_CPP_DIR (default ~/.cache/ladle-bench/llama-cpp), LLAMA_CPP_VERSION.
set -euo pipefail
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/ladle-bench/llama-cpp}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
ln -sfn "llama_cpp_python-$VERSION" src
[ -x venv/bin/python ] || "$PY" -m venv venv
venv/bin/pip install -q --upgrade pip
# Native build for this CPU (AVX-512 etc.), like ladle's own kernels; server extra for the
# OpenAI-compatible server used in the streaming comparison.
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  venv/bin/pip install -v "./llama_cpp_python-$VERSION[server]" > build.log 2>&1
# The converter's own dependencies (it imports torch only for some architectures; numpy,
# sentencepiece-free Qwen3 needs transformers' tokenizer).
venv/bin/pip install -q numpy pyyaml
echo "llama-cpp-python $VERSION built in $DIR (python: $DIR/venv/bin/python)"
