#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the sources vendored in the PyPI sdist of
# llama-cpp-python, for the side-by-side benchmark in benchmarks/bench_llamacpp.py.
#
#   benchmarks/llamacpp_build.sh            # prints the path of the built llama-server
#
# The sdist is the only download (`pip download --no-deps --no-binary :all:`); the CMake build
# itself is offline: no libcurl, no OpenSSL, no web UI (neither npm nor the prebuilt-UI
# download). Nothing lands in the repository: sources, build tree and binary stay under
# $PDSERVE_LLAMACPP_CACHE (default ~/.cache/pdserve/llamacpp). Idempotent: a finished build is
# reused. The compile runs at `nice -n 19` with $LLAMACPP_JOBS (default 2) jobs because it shares
# the machine.
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
CACHE="${PDSERVE_LLAMACPP_CACHE:-$HOME/.cache/pdserve/llamacpp}"
JOBS="${LLAMACPP_JOBS:-2}"
PY="${PYTHON:-python3}"
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
SRC="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$CACHE/build-$VERSION"
BIN="$BUILD/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$CACHE"
if [[ ! -f "$SDIST" ]]; then
    echo "llamacpp_build: downloading the llama-cpp-python==$VERSION sdist into $CACHE" >&2
    "$PY" -m pip download --quiet --no-deps --no-binary :all: --dest "$CACHE" \
        "llama-cpp-python==$VERSION" >&2 || {
        echo "llamacpp_build: could not download llama-cpp-python==$VERSION from the package" \
             "index (offline?); put $SDIST there by hand" >&2
        exit 1
    }
fi
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tar -xzf "$SDIST" -C "$CACHE"
fi
echo "llamacpp_build: configuring $SRC -> $BUILD" >&2
cmake -S "$SRC" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON >&2
echo "llamacpp_build: building llama-server (nice -n 19, -j$JOBS)" >&2
nice -n 19 cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
echo "$BIN"
