#!/usr/bin/env bash
# Run nnScaler 0.8's own policies -- pas_dp, pas_tp, pas_data, pas_pp, pas_hybrid from its
# nnscaler/policies.py, and swin's policy gallery (examples/vision/swin/policy/gallery.py with
# examples/utils.py) -- as custom pas_policy functions of this package, each against the
# single-device model (tests/parity.py: 2 gloo ranks, SGD, parameters compared), and print a table.
# Their files are read from a microsoft/nnscaler v0.8 checkout into WORKDIR (never into this
# repository) and run unchanged; the runner only adds stand-ins for imports this package does not
# have (listed in policy_runner.py). Not run by CI. Usage (from the repository root):
#   [NNSCALER08_REPO=/path/to/nnscaler(.git)] tests/nnscaler08/run_policies.sh [WORKDIR]
# (without NNSCALER08_REPO it clones microsoft/nnscaler's v0.8 into WORKDIR)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
WORK="${1:-/tmp/nns08_policies}"
SRC="${NNSCALER08_REPO:-}"
if [ -z "$SRC" ]; then  # no local copy named: clone v0.8 from GitHub (needs the network once)
  SRC="$WORK/nnscaler.git"
  [ -d "$SRC" ] || git clone --quiet --bare --branch 0.8 https://github.com/microsoft/nnscaler "$SRC" \
    || git clone --quiet --bare https://github.com/microsoft/nnscaler "$SRC"
fi
rm -rf "$WORK/upstream" && mkdir -p "$WORK/upstream"
git -C "$SRC" archive HEAD nnscaler/policies.py examples/__init__.py examples/utils.py examples/vision \
  | tar -x -C "$WORK/upstream"
cd "$REPO_ROOT"
PYTHON="${PYTHON:-python}"
PYTHONPATH="$REPO_ROOT:$HERE:$WORK/upstream${PYTHONPATH:+:$PYTHONPATH}" \
  "$PYTHON" -m policy_runner "$WORK"
