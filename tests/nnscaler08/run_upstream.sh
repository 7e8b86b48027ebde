#!/usr/bin/env bash
# Run nnScaler 0.8's own tests (microsoft/nnscaler v0.8: tests/cli/ and the tests/parallel_module/
# files that use only public names) against the installed nnscaler package, on CPU, outside this
# repository. Their test files run untouched; only their helper modules are replaced or adapted
# (harness/): a gloo launcher instead of their CUDA-only one, their GPU-count skip conditions
# evaluated with 4 devices (tests needing 8 stay skipped), internal imports of their helpers guarded;
# a test that needs a package this environment lacks (mosaicml-streaming, wandb) is skipped, naming it.
# Clones from GitHub (needs the network) unless NNSCALER08_SRC names a local git copy of
# microsoft/nnscaler (a path or URL git can clone); not run by CI. Usage:
#   [NNSCALER08_SRC=/path/to/nnscaler.git] tests/nnscaler08/run_upstream.sh [WORKDIR] [extra pytest args]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-/tmp/nns08}"; shift || true
UP="$WORK/upstream"
SRC="${NNSCALER08_SRC:-https://github.com/microsoft/nnscaler}"
if [ ! -d "$UP" ]; then
  # the v0.8 release is tagged "0.8" upstream; fall back to the default branch if the tag is missing
  git clone --quiet --branch 0.8 "$SRC" "$UP" 2>/dev/null \
    || git clone --quiet --branch v0.8 "$SRC" "$UP" 2>/dev/null \
    || git clone --quiet "$SRC" "$UP"
fi
rm -rf "$WORK/tests" "$WORK/stubs" && mkdir -p "$WORK/tests/cli" "$WORK/tests/parallel_module" "$WORK/stubs/streaming"
cp "$UP"/tests/__init__.py "$WORK/tests/"
cp -r "$UP"/tests/cli/. "$WORK/tests/cli/"
# parallel_module files whose imports are public names only (the others import nnScaler 0.8 internals)
for f in __init__ test_async test_broadcast test_checkpoint_buffer test_inference test_nested \
         test_reducer_hook test_submodule test_wholemodule; do
  cp "$UP/tests/parallel_module/$f.py" "$WORK/tests/parallel_module/"
done
cp "$HERE/harness/launch_torchrun.py" "$WORK/tests/launch_torchrun.py"
cp "$HERE/harness/conftest_upstream.py" "$WORK/tests/conftest.py"
cp "$HERE/harness/streaming_stub.py" "$WORK/stubs/streaming/__init__.py"
python "$HERE/harness/adapt.py" "$UP" "$WORK"
cd "$WORK"
export PYTHONPATH="$WORK/stubs"
python -m pytest -p no:cacheprovider -q -n 0 -rfEs tests/parallel_module "$@" || true
python -m pytest -p no:cacheprovider -q -n 0 -rfEs tests/cli "$@" || true
