#!/usr/bin/env bash
# The wheels benchmarks/tpu.sh needs beside the TPU machine's own packages. That machine holds
# Python 3.11 with JAX 0.10.2 and libtpu, reaches no registry, and its package index
# (/opt/pypi/simple) holds the large ones (tokenizers, pyarrow, matplotlib, tensorstore, ...),
# which tpu.sh installs from there; it lacks grain, and what it has of the rest is not pinned
# to this project's versions; tokamax (benchmarks/grouped_matmul.py only) and its imports come
# too. Run this where a registry is reachable, in any directory of the
# repository: it downloads the rest (Flax, Optax, Orbax and grain at pyproject.toml's pins, and
# what they import that the index lacks; ~14 MB) as Python 3.11 x86-64 wheels into .whl-tpu/
# (ignored by .gitignore), which the device tool carries (`carry: [".whl-tpu"]`) and tpu.sh
# installs with --no-deps.
#
#     bash benchmarks/tpu_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-tpu \
    flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 grain==0.2.18 array-record portpicker \
    treescope humanize simplejson aiofiles prometheus-client uvloop etils cloudpickle msgpack \
    tensorboardX==2.6.5 psutil rich==15.0.0 markdown-it-py mdurl pygments absl-py \
    pytest==9.2.0 pytest-xdist==3.8.0 execnet pluggy iniconfig hypothesis==6.170.17 \
    sortedcontainers attrs zstandard==0.25.0 \
    tokamax==0.0.12 pydantic pydantic-core typing-inspection annotated-types jaxtyping \
    wadler-lindig qwix einshape typeguard==2.13.3 immutabledict tqdm
du -sh .whl-tpu && ls .whl-tpu
