#!/usr/bin/env bash
# The GPU checks, in one run on a machine with a CUDA device, under that machine's python3 (no
# venv, no network): the CUDA tests (every op and algorithm on CUDA tensors, float32, float16 and
# bfloat16; staging, chunks, devices, allocations), a two-daemon training run of the digits CNN
# on cuda, and the GPU benchmark (benchmarks/gpu_bench.py). Ends with "N passed, N failed" and
# writes every result to one JSON file.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default: gpu-check/ (results: OUT_DIR/gpu_check.json)
#   GPU_CHECK_WHEELS=DIR scripts/gpu_check.sh   # install DIR/*.whl (to a temporary directory)
#                                               # first: packages the GPU machine lacks
#
# What it needs beside the repository: the generated protos (wire/v1/*_pb2*.py, made by the
# setup) and the SIGBUS guard (daemon/workers/sigbus.abi3.so, one build for every CPython 3.11+). With no GPU the CUDA tests skip, and so do the training run and the
# benchmark: the check says so.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
started=$(date +%s)

WHEELS=${GPU_CHECK_WHEELS:-}
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/decent-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/decent-site${PYTHONPATH:+:$PYTHONPATH}
fi
bash scripts/typing_links.sh   # the import names (decentd, decent, decent_wire) over the tree
export PYTHONPATH=$PWD/build/typing:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export DECENT_TEST_FORK=0  # daemons as python -m decentd: nothing here is installed for a fork server

gpu=$("$PY" - <<'PYTHON'
import sys

import torch

import decent.torch  # noqa: F401  (fails early when a package is missing)
import decentd.service.server  # noqa: F401

print("python", sys.version.split()[0], "torch", torch.__version__, file=sys.stderr)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYTHON
) || exit 1
echo "GPU: ${gpu:-none (the CUDA tests skip, and so do the training run and the benchmark)}"

"$PY" -m pytest -p no:cacheprovider -q -rfE --timeout 300 tests/test_cuda.py \
  --junitxml="$OUT/cuda_tests.xml" 2>&1 | tee "$OUT/cuda_tests.log"

train=skipped
bench=skipped
if [ -n "$gpu" ]; then
  "$PY" -m decentd.tools.launcher -np 2 --nodes 2 -- "$PY" examples/train_digits.py \
    --device cuda --epochs 3 --algorithms dsgd,gradient-tracking > "$OUT/train_digits.log" 2>&1
  train=$?
  tail -n 12 "$OUT/train_digits.log"
  "$PY" -m decentd.tools.launcher -np 2 --nodes 2 -- "$PY" benchmarks/gpu_bench.py \
    --json "$OUT/gpu_bench.json" > "$OUT/gpu_bench.log" 2>&1
  bench=$?
  tail -n 40 "$OUT/gpu_bench.log"
fi

"$PY" - "$OUT" "$train" "$bench" "$started" <<'PYTHON'
import json
import pathlib
import sys
import time
import xml.etree.ElementTree as ET

out, train, bench = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
started = int(sys.argv[4])


def state(code: str) -> str:
    return "skipped" if code == "skipped" else "passed" if code == "0" else "failed"


cases = []
xml = out / "cuda_tests.xml"
if xml.exists():
    for case in ET.parse(xml).getroot().iter("testcase"):
        got = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                got = "failed"
            elif child.tag == "skipped":
                got = "skipped"
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "state": got,
                      "seconds": float(case.get("time") or 0)})
cases += [{"test": "train_digits on cuda (2 daemons)", "state": state(train)},
          {"test": "gpu_bench", "state": state(bench)}]
bench_json = out / "gpu_bench.json"
result = {"tests": cases, "seconds": round(time.time() - started, 1),
          "benchmark": json.loads(bench_json.read_text()) if bench_json.exists() else None}
counts = {s: sum(c["state"] == s for c in cases) for s in ("passed", "failed", "skipped")}
result.update(counts)
(out / "gpu_check.json").write_text(json.dumps(result, indent=2))
skipped = f" ({counts['skipped']} skipped)" if counts["skipped"] else ""
print(f"{counts['passed']} passed, {counts['failed']} failed{skipped} in "
      f"{result['seconds']:.0f} s; results in {out / 'gpu_check.json'}")
sys.exit(1 if counts["failed"] else 0)
PYTHON
