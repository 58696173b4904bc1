#!/usr/bin/env bash
# Builds the virtualenv of the vLLM that tests/vllm checks Baton against (requirements.txt),
# cached under a key of that file: about 9.4 GB (torch and its CUDA libraries), 5-20 minutes on
# a new machine. Progress goes to stderr, the environment's python to stdout.
# `env.sh --where` prints that python without building anything.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(sha256sum "$here/requirements.txt" | cut -c1-12)"
out="${BATON_VLLM_ENV:-$HOME/.cache/baton/vllm-$key}"
if [ "${1:-}" = "--where" ]; then
  echo "$out/bin/python"
  exit 0
fi
# .complete is written last: an environment without it (an interrupted install) is rebuilt.
if [ ! -e "$out/.complete" ]; then
  started=$SECONDS
  echo "deploy/vllm: installing $(grep -v '^#' "$here/requirements.txt" | tr '\n' ' ')into $out" \
    "(about 9.4 GB; 5-20 minutes with nothing cached)" >&2
  rm -rf "$out"
  python3 -m venv "$out"
  "$out/bin/pip" install --quiet --upgrade pip >&2
  "$out/bin/pip" install --progress-bar off -r "$here/requirements.txt" >&2
  touch "$out/.complete"
  echo "deploy/vllm: done ($((SECONDS - started)) s)" >&2
fi
echo "$out/bin/python"
