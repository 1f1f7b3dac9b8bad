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
#
# Disk: four environments each hold the same torch wheel (about 0.8 GB unpacked). pip runs
# without its cache, and once an environment is built, every file in it that is byte-equal to
# one in the main .venv or in an environment already built is replaced by a hard link
# (util-linux `hardlink`; skipped with a note where it is missing or the trees are on
# different file systems). pip and Python replace files rather than rewrite them, so a later
# install into one environment never changes another. Builds run one at a time, so that each
# links against finished trees and the peak stays near the linked total.
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
pip=("$dir/bin/python" -m pip install --quiet --no-compile --no-cache-dir)
"${pip[@]}" "$torch_pin"
"${pip[@]}" --no-deps -r "$pins"
"${pip[@]}" --no-deps -e "$root"
if [ -n "$smoke" ]; then
    (cd "$dir" && "$dir/bin/python" -c "$smoke")
fi
before=$(du -sm "$dir" | cut -f1)
others=()
for other in "$root/.venv" "$(dirname "$dir")"/*/; do
    other="${other%/}"
    [ "$other" != "$dir" ] && [ -d "$other/lib" ] && others+=("$other")
done
if ! command -v hardlink >/dev/null 2>&1; then
    echo "envs/build.sh: no hardlink command (util-linux); $name keeps its own copies" >&2
elif [ ${#others[@]} -gt 0 ]; then
    # -t: equal content is enough (pip sets its own mtimes). Files are only linked, never changed.
    hardlink --quiet --ignore-time "$dir" "${others[@]}"
fi
# du counts a file with several links once, under the first tree named: the last line is what
# this environment holds that no other tree does.
own=$(du -sm "${others[@]}" "$dir" | tail -1 | cut -f1)
echo "envs/build.sh: built $name in $(( $(date +%s) - start )) s ($dir: $before MB, $own MB its own)"
