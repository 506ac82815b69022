#!/usr/bin/env bash
# Sets up everything from nothing: a virtualenv in .venv with decent, torch and TensorFlow (CPU
# builds) and dev tools.
# Re-running is cheap: it reinstalls only when pyproject.toml, setup.py or proto/ changed.
# `scripts/setup.sh bench` also installs the benchmark extra (hivemind, for `make bench`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
want=$(cat pyproject.toml setup.py proto/decent/v1/*.proto daemon/workers/sigbus.c | sha256sum | cut -d' ' -f1)
# the daemon's SIGBUS guard (daemon/workers/sigbus.c) is compiled at install: a C compiler and the
# Python headers are needed (installed here when missing, on Debian/Ubuntu or Fedora/RHEL)
system_install() {
  local as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo)
  if command -v apt-get >/dev/null; then
    "${as_root[@]}" apt-get update -qq && "${as_root[@]}" apt-get install -y -qq "$@"
  elif command -v dnf >/dev/null; then
    # Fedora/RHEL name two of Debian's packages otherwise
    local names=("${@/libc6-dev/glibc-devel}")
    "${as_root[@]}" dnf install -y -q "${names[@]/python3-dev/python3-devel}"
  else
    echo "install a C compiler and the Python headers ($*), then run this again" >&2
    exit 1
  fi
}
if ! command -v cc >/dev/null; then
  echo "installing a C compiler"
  system_install gcc libc6-dev
fi
# the fault tests reset a peer link with `ss -K`; the netns tests use `ip` and `tc`
if ! command -v ss >/dev/null || ! command -v ip >/dev/null; then
  echo "installing iproute2 (ss, ip, tc)"
  system_install iproute2
fi
headers=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if [ ! -f "$headers/Python.h" ]; then
  echo "installing the Python headers"
  system_install python3-dev
fi
pip_install() {
  # some machines list local package mirrors that may be empty; pip warns per package about them
  .venv/bin/python -m pip install -q "$@" 2> >(grep -v "^WARNING: Location '" >&2)
}
stamp=.venv/.decent-setup
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -f wire/v1/decent_pb2.py ] \
   || ! compgen -G "daemon/workers/sigbus*.so" >/dev/null
then
  echo "setting up .venv (first run takes a minute or two)"
  pip_install --upgrade pip
  # the CPU build of torch first: a looser requirement would pull a multi-GB CUDA build
  pip_install "torch==2.13.0"
  pip_install -e ".[torch,tf,dev]"
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "bench" ]; then
  bench_stamp=.venv/.decent-bench
  if [ ! -f "$bench_stamp" ] || [ "$(cat "$bench_stamp")" != "$want" ]; then
    echo "installing the benchmark extra (hivemind, py-spy)"
    pip_install -e ".[torch,dev,bench]"
    echo "$want" > "$bench_stamp"
  fi
fi
