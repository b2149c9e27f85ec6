#!/usr/bin/env bash
# One GPU lease's run of the GPU benchmark on a lent machine (the workplace's device tool), from the
# repository root there: the packages its image lacks travel as wheels in .whl/ (see
# docs/benchmarks/README.md), the log goes to $OUT/gpu.log. Arguments go to tests.benchmarks.gpu.
#   run: bash tests/benchmarks/gpu_lease.sh --seconds 3 --rounds 3   (carry: .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L
nproc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
out=${OUT:-/tmp}
timeout "${BENCH_TIMEOUT_S:-520}" python3 -m tests.benchmarks.gpu "$@" 2>&1 | tee "$out/gpu.log"
echo "exit ${PIPESTATUS[0]}"
