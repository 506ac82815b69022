#!/usr/bin/env bash
# Sets up everything from nothing: a virtualenv in .venv with decent, torch (CPU) and dev tools.
# Re-running is cheap: it reinstalls only when pyproject.toml, setup.py or proto/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.decent-setup
want=$(cat pyproject.toml setup.py proto/decent/v1/*.proto | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f clients/decent/v1/decent_pb2.py ]; then
  exit 0
fi
echo "setting up .venv (first run takes a minute or two)"
pip_install() {
  # some machines list local package mirrors that may be empty; pip warns per package about them
  .venv/bin/python -m pip install -q "$@" 2> >(grep -v "^WARNING: Location '" >&2)
}
pip_install --upgrade pip
# the CPU build of torch first: a looser requirement would pull a multi-GB CUDA build
pip_install "torch==2.13.0"
pip_install -e ".[torch,dev]"
echo "$want" > "$stamp"
