#!/usr/bin/env bash
# Installs sltune into the active Python environment (make one first: python3 -m venv .venv && . .venv/bin/activate).
# The one way to install it: the README's two commands, the guides and CI (.ci/run) all run this script.
#
#   bash scripts/install.sh            the package: tune, train, serve, plan (SpeedLoader and FSDP2)
#   bash scripts/install.sh backends   ... and DeepSpeed, its CPU ops built now (not in a trial's first minutes)
#   bash scripts/install.sh ray        ... and Ray: trials on a Ray cluster (hardware.executor ray)
#   bash scripts/install.sh test       ... and what the test suite and the docs build need, Ray and DeepSpeed among
#                                      them: the README's "Test it"
#
# torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build. An environment that has a torch
# already (a CUDA build on a GPU machine, say) keeps it; SLTUNE_TORCH names another pin.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-package}"
case "$what" in
    package) extras="" ; backends=0 ;;
    backends) extras="" ; backends=1 ;;
    ray) extras="[ray]" ; backends=0 ;;
    test) extras="[test,docs,ray]" ; backends=1 ;;
    *) echo "install.sh: unknown '$what': give nothing, 'backends', 'ray' or 'test'" >&2; exit 2 ;;
esac
say() { echo "install.sh: $*"; }

python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    say "torch (${SLTUNE_TORCH:-torch==2.13.0})"
    pip install --quiet "${SLTUNE_TORCH:-torch==2.13.0}"
fi
say "sltune${extras}"
pip install --quiet -e ".${extras}"

if [ "$backends" = 1 ]; then
    # DeepSpeed against the torch above: without build isolation (an isolated build would fetch another torch),
    # without resolving its dependencies (the same reason; its runtime requirements, none of which needs torch, come
    # next), with the ops a trial loads compiled now: CPU Adam (the optimizer offloaded) and, on the CPU accelerator,
    # the shared-memory all-reduce. No cached wheel, which may have been built without them.
    # (sltune.backends.deepspeed_ops reads the same list of ops, and builds what a job needs once if they are missing.)
    accelerator=$(python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
    if python -m sltune.backends.deepspeed_ops --check "$accelerator" 2>/dev/null; then
        say "DeepSpeed is installed with its ops built for $accelerator: kept"
    else
        say "DeepSpeed with its ops built for $accelerator (compiling: about 4 minutes on 2 cores)"
        pip install --quiet 'setuptools>=70.1' wheel
        shm=$([ "$accelerator" = cpu ] && echo 1 || echo 0)
        DS_ACCELERATOR="$accelerator" DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM="$shm" \
            pip install --quiet --no-cache-dir --no-build-isolation --no-deps --force-reinstall 'deepspeed>=0.19'
        pip install --quiet hjson ninja py-cpuinfo msgpack einops
        python -m sltune.backends.deepspeed_ops --check "$accelerator"
    fi
fi
say "done ($(python -c "import torch, sltune; print('torch', torch.__version__, '· sltune', sltune.__version__)"))"
