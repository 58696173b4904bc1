#!/usr/bin/env bash
# On the lent GPU machine, in the repository's root: rejoin the wheels `baton bench gpu prepare`
# split into carried folders (.gpu/carry-*), check each against deploy/vllm/gpu/requirements.txt's
# sha256, and install them into SITE (default /tmp/baton-gpu/site) without an index or their
# dependencies (the image has the rest). Installing again is a no-op.
set -euo pipefail
site=${1:-/tmp/baton-gpu/site}
if [[ -f $site/.complete ]]; then
  echo "installed: $site"
  exit 0
fi
wheels=/tmp/baton-gpu/wheels
rm -rf "$wheels" && mkdir -p "$wheels"
shopt -s nullglob
for whole in .gpu/carry-*/*.whl; do cp "$whole" "$wheels/"; done
for first in .gpu/carry-*/*.whl.part00; do
  name=$(basename "${first%.part00}")
  # parts in their numbered order, whichever folders carried them
  for part in $(for p in .gpu/carry-*/"$name".part*; do echo "${p##*.part} $p"; done | sort | cut -d' ' -f2); do
    cat "$part"
  done > "$wheels/$name"
done
python3 - "$wheels" <<'PY'
import hashlib, pathlib, re, sys
wanted = {}
for line in pathlib.Path("deploy/vllm/gpu/requirements.txt").read_text().splitlines():
    if line and not line.startswith("#"):
        name, digest = re.match(r"(\S+)==\S+ --hash=sha256:(\w+)", line).groups()
        wanted[digest] = name
found = {hashlib.sha256(p.read_bytes()).hexdigest(): p.name for p in pathlib.Path(sys.argv[1]).glob("*.whl")}
missing = sorted(name for digest, name in wanted.items() if digest not in found)
strays = sorted(name for digest, name in found.items() if digest not in wanted)
if missing or strays:
    sys.exit(f"carried wheels do not match requirements.txt: missing or corrupt {missing}, unknown {strays}; carry every .gpu/carry-* folder again")
print(f"{len(found)} wheels match requirements.txt")
PY
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
touch "$site/.complete"
echo "installed: $site"
