#!/usr/bin/env bash
# One GPU check on a lent NVIDIA machine (an H200): the node agent's probe, a CUDA llama-server
# built there, and `continuum plan`'s device bytes against what llama.cpp logged it allocated
# (the receipt) and what NVML says the server process holds.
#
#   bash tools/device_check.sh prepare   here, with network: fill .device/ (wheels, llama.cpp)
#   bash tools/device_check.sh           on the device machine: results under $OUT
#   DRY=1 OUT=/tmp/dc bash tools/device_check.sh
#                                        anywhere: no CUDA build; a fake llama-server prints a
#                                        FABRICATED log, so every Python path runs without a GPU
#
# Nothing here is tracked in git: .device/ is ignored through .git/info/exclude and travels to
# the device machine only as a `carry` path. Every step logs and carries on when it fails; the
# whole run keeps inside BUDGET seconds (default 465) on its own clock.
#
# Outputs under $OUT (at most 8 files):
#   device_check.log   everything this script printed
#   probe.txt          tools/device_probe.py's stdout and stderr
#   h200-discrete.json the probe's capture (a tests/fixtures/probes fixture)
#   compare.json       per run: plan estimate, receipt, NVML per-process bytes, ratios
#   compare.txt        the same as a table
#   logs.tar.gz        llama-server logs, the Engines and board planned, cmake logs, nvidia-smi,
#                      and tools/device_gpu_paths.py's attribution.json, mps.json, cpu-only.json
#                      (a pod's GPU process read from a sibling cgroup namespace as the agent's
#                      user; an MPS client's limit below and above the daemon's default; the
#                      image's llama-server build started with libcuda hidden)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
DEV="$ROOT/.device"
LLAMA_CPP_PYTHON_VERSION="$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION=//p' tools/versions)"

# --- prepare (here, with network) ---------------------------------------------------------
# Wheels the device image lacks (it has numpy, pyyaml, psutil, nvidia-ml-py, prometheus-client,
# aiohttp, requests, six, python-dateutil, click, certifi, urllib3): what `continuum`'s import
# chain needs beyond it (kopf only inside `continuum operator`, so it stays behind; kubernetes,
# the agent's extra, no command of the check imports since the login is our own: kept for the
# version line below), and setuptools for the editable install's build.
WHEELS=(
  "pydantic>=2.7,<3" pydantic-core annotated-types typing-inspection "typing-extensions>=4.16"
  "gguf>=0.10"
  "kubernetes>=30" durationpy oauthlib requests-oauthlib websocket-client
  "setuptools>=77"
)

prepare() {
  local py="${PREPARE_PYTHON:-python3}" sdist tmp src dst commit
  mkdir -p "$DEV/wheels"
  grep -qx '/.device/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.device/' >>.git/info/exclude; }
  rm -f "$DEV"/wheels/*.whl
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --dest "$DEV/wheels" "${WHEELS[@]}" || return 1

  sdist="${CONTINUUM_CACHE:-$HOME/.cache/continuum}/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
  if ! [[ -s "$sdist" ]]; then
    sdist="/tmp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    [[ -s "$sdist" ]] || "$py" -m pip download --quiet --no-deps --no-binary :all: --dest /tmp \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" || return 1
  fi
  tmp="$(mktemp -d)"
  tar -xzf "$sdist" -C "$tmp" "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" \
    "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/CHANGELOG.md" || return 1
  src="$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  dst="$DEV/llama.cpp"
  rm -rf "$dst"
  mkdir -p "$dst/tools" "$dst/ggml/src" "$dst/scripts"
  # What `cmake --build --target llama-server` reads, and nothing else: top-level cmake, the
  # libraries (ggml with its CPU and CUDA backends only, llama, common, vendor), and the tools
  # the server links (server, mtmd, ui with no UI sources: the UI is neither built nor fetched).
  cp "$src"/CMakeLists.txt "$src"/LICENSE "$dst/"
  cp -r "$src"/cmake "$src"/include "$src"/src "$src"/common "$src"/vendor "$src"/licenses "$dst/"
  cp "$src"/scripts/ui-assets.cmake "$dst/scripts/" 2>/dev/null || true
  cp -r "$src"/ggml/CMakeLists.txt "$src"/ggml/cmake "$src"/ggml/include "$dst/ggml/"
  find "$src/ggml/src" -maxdepth 1 -type f -exec cp {} "$dst/ggml/src/" \;
  cp -r "$src"/ggml/src/ggml-cpu "$src"/ggml/src/ggml-cuda "$dst/ggml/src/"
  cp -r "$src"/tools/server "$src"/tools/mtmd "$dst/tools/"
  rm -rf "$dst"/tools/server/tests "$dst"/tools/server/bench "$dst"/tools/server/themes
  mkdir -p "$dst/tools/ui"
  cp "$src"/tools/ui/CMakeLists.txt "$src"/tools/ui/*.in "$src"/tools/ui/sources.cmake \
    "$src"/tools/ui/package.json "$dst/tools/ui/" 2>/dev/null || true
  cat >"$dst/tools/CMakeLists.txt" <<'EOF'
# Pruned by tools/device_check.sh prepare: only what llama-server links.
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(ui)
add_subdirectory(server)
add_subdirectory(mtmd)
EOF
  commit="$(awk -v v="$LLAMA_CPP_PYTHON_VERSION" '
    $0 ~ "^## \\[" v "\\]" { on = 1; next }
    on && /^## \[/ { exit }
    on && match($0, /llama\.cpp@[0-9a-f]+/) { print substr($0, RSTART + 10, RLENGTH - 10); exit }
  ' "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/CHANGELOG.md")"
  echo "${commit:-unknown}" >"$dst/CONTINUUM_COMMIT"
  echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION vendor/llama.cpp, pruned by tools/device_check.sh prepare" >"$dst/CONTINUUM_SOURCE"
  rm -rf "$tmp"
  echo "prepared $DEV: $(du -sb --apparent-size "$DEV" | cut -f1) bytes" \
    "(wheels $(du -sb --apparent-size "$DEV/wheels" | cut -f1), llama.cpp $(du -sb --apparent-size "$dst" | cut -f1))"
}

if [[ "${1:-}" == "prepare" ]]; then
  prepare
  exit $?
fi

# --- the check (on the device machine) ----------------------------------------------------
DRY="${DRY:-0}"
BUDGET="${BUDGET:-465}"
T0="$(date +%s)"
OUT="${OUT:-$ROOT/_out/device_check}"
mkdir -p "$OUT"
WORK="${DC_WORK:-/tmp/device_check}"
rm -rf "$WORK"
mkdir -p "$WORK/logs"
exec > >(tee -a "$OUT/device_check.log") 2>&1
export PYTHONUNBUFFERED=1

el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(el) )); }
say() { printf '[%3ss] %s\n' "$(el)" "$*"; }

say "device check: DRY=$DRY BUDGET=${BUDGET}s OUT=$OUT WORK=$WORK; $(nproc) cores; $(uname -m)"
BUILD_DIR="$WORK/build"
SERVER="$BUILD_DIR/bin/llama-server"
BUILD_DONE="$WORK/build.done"   # holds the build's exit code once it ends

# c. the CUDA build of llama-server, in the background from the first second.
build_server() {
  local src="$DEV/llama.cpp" commit nvcc root
  nvcc="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1)"
  root="${nvcc:+$(dirname "$(dirname "$(readlink -f "$nvcc")")")}"
  commit="$(cat "$src/CONTINUUM_COMMIT" 2>/dev/null || echo unknown)"
  [[ -f "$src/CMakeLists.txt" ]] || { echo "no $src: carry .device"; return 2; }
  echo "configure: llama.cpp $commit; nvcc ${nvcc:-missing} ($("${nvcc:-false}" --version 2>&1 | tail -1));" \
    "toolkit $root: $(ls "$root"/lib64/libcublas.so* "$root"/lib/libcublas.so* 2>/dev/null | head -2 | tr '\n' ' ');" \
    "$(cmake --version | head -1); ninja $(ninja --version 2>&1); gcc $(gcc -dumpfullversion 2>&1)"
  timeout 120 cmake -S "$src" -B "$BUILD_DIR" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    ${nvcc:+-DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$root"} \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_COMPRESSION_MODE=none \
    -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_COMMIT="$commit" >"$WORK/logs/cmake-configure.log" 2>&1 \
    || { tail -30 "$WORK/logs/cmake-configure.log"; return 3; }
  echo "configured in $(el)s; building llama-server with -j$(nproc)"
  # Bounded by the budget: the build never outlives the check (timeout ends its process group).
  timeout "$(( $(left) > 30 ? $(left) - 15 : 15 ))" \
    cmake --build "$BUILD_DIR" --target llama-server -j "$(nproc)" >"$WORK/logs/cmake-build.log" 2>&1 \
    || { grep -m5 -B2 -A8 'error' "$WORK/logs/cmake-build.log" | head -60; return 4; }
  [[ -x "$SERVER" ]] || return 5
}

if [[ "$DRY" == 1 ]]; then
  say "DRY: no CUDA build; a fake llama-server stands in"
  echo 0 >"$BUILD_DONE"
else
  ( build_server >"$WORK/logs/build-steps.log" 2>&1; rc=$?; echo "$rc" >"$BUILD_DONE"
    echo "build ended in $(el)s, exit $rc" >>"$WORK/logs/build-steps.log" ) >/dev/null 2>&1 &
  BUILD_PID=$!
  # Progress: ninja's "[n/N]" every 20 s until the build ends.
  (
    while [[ ! -f "$BUILD_DONE" ]]; do
      sleep 20
      p="$(tail -c 2000 "$WORK/logs/cmake-build.log" 2>/dev/null | grep -o '^\[[0-9]*/[0-9]*\]' | tail -1)"
      say "build: ${p:-configuring} ($(tail -1 "$WORK/logs/build-steps.log" 2>/dev/null | cut -c1-100))"
    done
  ) &
  PROGRESS_PID=$!
fi

# nvidia-smi once, for the record.
( timeout 20 nvidia-smi; timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv ) \
  >"$WORK/logs/nvidia-smi.txt" 2>&1 || say "nvidia-smi: failed (see logs/nvidia-smi.txt)"
head -20 "$WORK/logs/nvidia-smi.txt" | sed 's/^/  /'

# a. the Python environment: a venv over the image's packages, the carried wheels, the repo.
VENV="$WORK/venv"
PY=""
setup_python() {
  local parent
  # The image's python3 is itself a venv (/opt/torch/.venv): --system-site-packages would only
  # reach its base interpreter, so a .pth names the parent's own site-packages (torch, pynvml).
  parent="${DC_PARENT_SITE:-$(python3 -c 'import site; print("\n".join(site.getsitepackages()))')}"
  if timeout 60 python3 -m venv --system-site-packages "$VENV"; then
    printf '%s\n' "$parent" >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_device_check_parent.pth"
    PY="$VENV/bin/python"
  else
    say "venv: python3 -m venv failed; installing into $WORK/site on PYTHONPATH instead"
    PY="python3"
  fi
  # --no-deps: every wheel the image lacks is carried; the resolver would only trip on the
  # image's own (older) pins that the imports do not care about.
  local wheels=()
  for w in "$DEV"/wheels/*.whl; do
    [[ "$(basename "$w")" == setuptools-* ]] || wheels+=("$w")
  done
  if [[ "$PY" == python3 ]]; then
    timeout 90 python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "${wheels[@]}" \
      || say "pip: installing the carried wheels failed"
    export PYTHONPATH="$WORK/site:$ROOT/operator"
  else
    timeout 90 "$PY" -m pip install -q --no-index --no-deps --find-links "$DEV/wheels" "${wheels[@]}" \
      || say "pip: installing the carried wheels failed"
    # Editable, without deps; the isolated build takes setuptools from the carried wheels.
    if ! timeout 60 "$PY" -m pip install -q --no-index --no-deps --find-links "$DEV/wheels" -e "$ROOT"; then
      say "pip: editable install failed; using PYTHONPATH=operator"
      export PYTHONPATH="$ROOT/operator"
    fi
  fi
}
setup_python
say "python: $PY ($("$PY" -V 2>&1)); $("$PY" -c 'import pydantic, gguf, kubernetes; print("pydantic", pydantic.VERSION, "gguf ok, kubernetes", kubernetes.__version__)' 2>&1 | tail -1)"

# b. the node agent's probe, as tools/device_probe.py captures it.
say "probe: tools/device_probe.py"
PROBE_ARGS=(--expect discrete --where "lent H200" --out "$OUT/h200-discrete.json" --repeat 5)
[[ "$DRY" == 1 ]] && PROBE_ARGS=(--replay-nvml tests/fixtures/probes/x86-h100-hmm.json --repeat 2)
timeout 60 "$PY" tools/device_probe.py "${PROBE_ARGS[@]}" >"$OUT/probe.txt" 2>&1
say "probe: exit $? (0 discrete as expected, 3 another mode, 1 no NVIDIA); $(grep -m1 'memoryMode' "$OUT/probe.txt")"

# g. the GPU paths the CPU cannot show (tools/device_gpu_paths.py), while the build runs:
#    attribution from a sibling cgroup namespace as the agent's user, and MPS limits.
GPU_PATHS="$WORK/logs/gpu-paths"
mkdir -p "$GPU_PATHS"
if [[ "$DRY" != 1 ]]; then
  for check in attribution mps; do
    timeout 90 "$PY" tools/device_gpu_paths.py "$check" --out "$GPU_PATHS" 2>&1 | tail -3 | sed "s/^/  $check| /"
  done
fi

# d/e. models, plans, llama-server runs and the comparison: tools/device_check.py.
DC_ARGS=(--work "$WORK" --out "$OUT" --server "$SERVER" --build-done "$BUILD_DONE" --deadline $(( T0 + BUDGET - 25 )))
[[ "$DRY" == 1 ]] && DC_ARGS+=(--dry)
[[ -f "$OUT/h200-discrete.json" ]] && DC_ARGS+=(--probe "$OUT/h200-discrete.json")
say "runs: tools/device_check.py (left ${BUDGET}s budget: $(left)s)"
timeout "$(( $(left) > 30 ? $(left) - 15 : 15 ))" "$PY" tools/device_check.py "${DC_ARGS[@]}"
say "runs: exit $?"

# h. the image's CPU-only path: this build (GGML_BACKEND_DL, shared, as images/engine builds
#    it) started with every libcuda.so* hidden, as NVIDIA_VISIBLE_DEVICES=void leaves a pod.
if [[ "$DRY" != 1 && -x "$SERVER" && -f "$WORK/models/tiny.gguf" ]]; then
  timeout 90 "$PY" tools/device_gpu_paths.py cpu-only --out "$GPU_PATHS" --server "$SERVER" \
    --model "$WORK/models/tiny.gguf" 2>&1 | tail -3 | sed 's/^/  cpu-only| /'
fi

# f. wrap up whatever state the build is in.
if [[ "$DRY" != 1 ]]; then
  if [[ -f "$BUILD_DONE" ]]; then
    say "build: exit $(cat "$BUILD_DONE"); $(tail -1 "$WORK/logs/build-steps.log")"
    [[ "$(cat "$BUILD_DONE")" == 0 ]] || tail -25 "$WORK/logs/build-steps.log" | sed 's/^/  build| /'
  else
    say "build: still running at the deadline ($(tail -c 2000 "$WORK/logs/cmake-build.log" 2>/dev/null | grep -o '^\[[0-9]*/[0-9]*\]' | tail -1))"
    kill -- "$BUILD_PID" 2>/dev/null
  fi
  kill "$PROGRESS_PID" 2>/dev/null
  [[ -f "$WORK/logs/cmake-build.log" ]] && tail -c 200000 "$WORK/logs/cmake-build.log" >"$WORK/logs/cmake-build.tail.log"
  rm -f "$WORK/logs/cmake-build.log"
fi
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null || say "tar: failed"
say "done in $(el)s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
sleep 1  # let tee write the last lines to device_check.log
