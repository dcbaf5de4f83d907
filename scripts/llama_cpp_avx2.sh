#!/usr/bin/env bash
# llama.cpp's library built for AVX2 only (no AVX512), for the bench's AVX2 class: llama.cpp picks
# its CPU kernels when it is compiled, so the variables that hold torch to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2) do not reach it.
# Builds the installed llama-cpp-python's own llama.cpp (from its sdist) into $OUT and prints the
# variable that makes llama-cpp-python load it:
#   LLAMA_CPP_LIB_PATH=$OUT draftheads bench --peers llama.cpp --dtype float32 ...
# Usage: scripts/llama_cpp_avx2.sh [OUT]   (default ~/.cache/draftheads/engines/llama-avx2; ~6 min on 2 cores)
set -euo pipefail
OUT="${1:-$HOME/.cache/draftheads/engines/llama-avx2}"
PYTHON="${PYTHON:-python}"
VERSION="$("$PYTHON" -c 'import llama_cpp; print(llama_cpp.__version__)')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
cmake -S "$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX_VNNI=OFF \
  -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_COMMON=OFF > "$WORK/cmake.log"
cmake --build "$WORK/build" --target llama -j "$(nproc)" > "$WORK/build.log"
mkdir -p "$OUT"
cp -a "$WORK"/build/bin/*.so* "$OUT"/
echo "LLAMA_CPP_LIB_PATH=$OUT"
