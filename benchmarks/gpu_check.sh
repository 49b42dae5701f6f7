#!/bin/sh
# The prepared GPU check (benchmarks/gpu_check.py), in the two places it runs:
#   sh benchmarks/gpu_check.sh wheels   here, with pip's index reachable: the wheels the lent machine lacks
#                                       (torchao for 8-bit AdamW and NF4, platformdirs) into .whl/ (git-ignored)
#   sh benchmarks/gpu_check.sh          on the lent machine, through the device tool: command
#                                       "sh benchmarks/gpu_check.sh", carry [".whl"]; results in $OUT
set -e
cd "$(dirname "$0")/.."
if [ "$1" = "wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    for w in torchao==0.18.0 platformdirs==4.3.8; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$w"
    done
    ls .whl
    exit 0
fi
# Installed for the whole machine, not on PYTHONPATH: the job workers start without the app's PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
nvidia-smi || true
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "${OUT:-/tmp/gpu-check}" "$@"
