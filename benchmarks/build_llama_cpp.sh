#!/usr/bin/env bash
# Builds llama.cpp for benchmarks/compare.py and benchmarks/gguf_accuracy.py, outside the
# repository: llama-cpp-python (from its PyPI sdist, into a virtual environment) for the
# in-process single-stream numbers, its quantize API (compare.py makes the Q8_0 and Q4_K_M files
# with it) and its full logits (gguf_accuracy.py), and the llama-server binary from the llama.cpp
# sources vendored in that same sdist, for the batched and server comparisons (it batches
# parallel slots; llama-cpp-python's own server runs one request at a time), with its
# llama-quantize tool (the types whose quantize needs an importance matrix). The sdist also ships
# llama.cpp's HF -> GGUF converter and gguf-py, which compare.py runs to convert the random
# checkpoints. Takes many minutes on a small machine; run it early:
#     nice -n 19 benchmarks/build_llama_cpp.sh
# Environment: LLAMA_CPP_DIR (default ~/.cache/ladle-bench/llama-cpp), LLAMA_CPP_VERSION, PYTHON,
# LLAMA_CPP_ISA (cmake flags choosing the instruction sets; default -DGGML_NATIVE=ON: all of this
# CPU's). On a KVM Xeon its AMX buffers crashed (compare.py --llama-no-repack); a build without
# AMX that keeps the other repacking, into another LLAMA_CPP_DIR:
#     LLAMA_CPP_ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
#       -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
#       -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
set -euo pipefail
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/ladle-bench/llama-cpp}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
PY=${PYTHON:-python3}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
ISA=${LLAMA_CPP_ISA:--DGGML_NATIVE=ON}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
ln -sfn "llama_cpp_python-$VERSION" src
[ -x venv/bin/python ] || "$PY" -m venv venv
if ! venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  venv/bin/pip install -q --upgrade pip
  # Built for this CPU ($ISA; by default native, as ladle's own kernels are); the server extra is
  # the fallback server when llama-server is not built (it runs one request at a time).
  CMAKE_ARGS="$ISA -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    venv/bin/pip install -v "./llama_cpp_python-$VERSION[server]" > build.log 2>&1
fi
if [ ! -x server-build/bin/llama-server ] || [ ! -x server-build/bin/llama-quantize ]; then
  cmake -S "llama_cpp_python-$VERSION/vendor/llama.cpp" -B server-build -G Ninja \
    -DCMAKE_BUILD_TYPE=Release $ISA -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    > server-build.log 2>&1
  # llama-quantize: for the types its quantize needs an importance matrix for (compare.py).
  cmake --build server-build --target llama-server llama-quantize -j "$JOBS" >> server-build.log 2>&1
fi
echo "llama.cpp ready in $DIR: python $DIR/venv/bin/python, server $DIR/server-build/bin/llama-server"
