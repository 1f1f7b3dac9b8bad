#!/usr/bin/env bash
# Build one engine environment from its pinned file: bash envs/build.sh NAME
#
# envs/NAME.txt lists every package of the environment, pinned. The environment is made
# from scratch in .venv-engines/NAME (or $TORCHLENS_ENGINE_ENVS/NAME): torch first (its line
# in the file, so pip takes the CPU wheel instead of resolving a CUDA build), then the whole
# file with --no-deps (the file is the complete environment, nothing else is resolved),
# then TorchLens from this checkout (it needs only torch). The file's `# smoke:` line is run
# last; the build fails if it raises. The Makefile's `engines` target calls this script
# when the file (or this script) is newer than the environment.
set -euo pipefail
name="${1:?usage: bash envs/build.sh NAME   (one of: $(cd "$(dirname "$0")" && ls *.txt | sed 's/\.txt$//' | tr '\n' ' '))}"
root="$(cd "$(dirname "$0")/.." && pwd)"
pins="$root/envs/$name.txt"
[ -f "$pins" ] || { echo "envs/build.sh: no envs/$name.txt" >&2; exit 2; }
dir="${TORCHLENS_ENGINE_ENVS:-$root/.venv-engines}/$name"
python="${PYTHON:-python3}"
torch_pin="$(grep -E '^torch==' "$pins")"
smoke="$(sed -n 's/^# smoke: //p' "$pins")"

start=$(date +%s)
rm -rf "$dir"
"$python" -m venv "$dir"
"$dir/bin/python" -m pip install --quiet --no-compile "$torch_pin"
"$dir/bin/python" -m pip install --quiet --no-compile --no-deps -r "$pins"
"$dir/bin/python" -m pip install --quiet --no-compile --no-deps -e "$root"
if [ -n "$smoke" ]; then
    (cd "$dir" && "$dir/bin/python" -c "$smoke")
fi
echo "envs/build.sh: built $name in $(( $(date +%s) - start )) s ($dir)"
