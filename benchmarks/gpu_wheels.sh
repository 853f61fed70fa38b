#!/usr/bin/env bash
# The wheels benchmarks/accelerator.sh needs beside the GPU image's own packages: the image holds
# Python 3.12 with JAX 0.11.2, Flax, Optax, Orbax and most of what they import, and reaches no
# package registry; it lacks grain (imported by moebalance.data) with array_record and
# portpicker, and tensorboardX. Run this where a registry is reachable, in any directory of the
# repository: it downloads them as Python 3.12 x86-64 wheels into .whl/ (kept out of git by
# .git/info/exclude), which the device tool carries (`carry: [".whl"]`) and accelerator.sh installs.
#
#     bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5
ls -l .whl
