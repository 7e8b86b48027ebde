#!/usr/bin/env bash
# Run nnScaler 0.8's own examples (microsoft/nnscaler v0.8, examples/) against the installed nnscaler
# package, on CPU with gloo, outside this repository; not run by CI. A fresh copy of their examples/
# is adapted by examples/adapt.py with only what an offline CPU machine forces, each change listed in
# the table it prints (examples/run.py):
#   - hub ids -> tiny local model directories (random weights, word-level tokenizer), made by
#     examples/offline_assets.py; downloads -> synthetic data (nanoGPT's input.txt, bookcorpus, cifar10);
#   - CPU: swin's cuda device / model.cuda(), its Config sizes; num_proc 32 -> 1;
#   - the examples' commented-out loss-printing hooks turned on, and a print of the loss where an
#     example keeps it to itself (compile_hf, swin), for the table;
#   - run sizes (steps, layers, sequence length) through each example's own command-line options.
# Rows: nanoGPT's train_cli.py with its YAML (plan 1, plan 2), its Lightning train_nnscaler.py,
# llama3_demo on 2 ranks then resumed, vit_cli with its YAML, huggingface_nlp/compile_hf.py on a tiny
# Llama, vision/swin/train.py with its gallery policies (these last two use nnScaler 0.8's policy API).
# Packages the examples import that this environment lacks (datasets and its dependencies, swin's
# more-itertools) are
# installed beside it, under WORKDIR/site (needs the network once). Clones from GitHub unless
# NNSCALER08_SRC / NANOGPT_SRC name local git copies of microsoft/nnscaler / karpathy/nanoGPT. Usage:
#   [NNSCALER08_SRC=...] [NANOGPT_SRC=...] tests/nnscaler08/run_examples.sh [WORKDIR] [--only PREFIX,...]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-/tmp/nns08_examples}"; shift || true
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
UP="$WORK/upstream"
SRC="${NNSCALER08_SRC:-https://github.com/microsoft/nnscaler}"
NANOGPT="${NANOGPT_SRC:-https://github.com/karpathy/nanoGPT}"
PY="${PYTHON:-python}"
if [ ! -d "$UP" ]; then
  # the v0.8 release is tagged "0.8" upstream; fall back to the default branch if the tag is missing
  git clone --quiet --branch 0.8 "$SRC" "$UP" 2>/dev/null \
    || git clone --quiet --branch v0.8 "$SRC" "$UP" 2>/dev/null \
    || git clone --quiet "$SRC" "$UP"
fi
SITE="$WORK/site"
if ! PYTHONPATH="$SITE" "$PY" -c "import datasets, more_itertools" 2>/dev/null; then
  "$PY" -m pip install --quiet --target "$SITE" --no-deps \
    datasets pyarrow pandas dill multiprocess python-dateutil pytz tzdata six xxhash more-itertools
fi
exec "$PY" "$HERE/examples/run.py" --upstream "$UP" --nanogpt "$NANOGPT" --work "$WORK" \
  --pythonpath "$SITE" "$@"
