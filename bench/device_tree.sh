#!/usr/bin/env bash
# The checkout that travels with a device call is at most 64 MiB; the shipped drafts' weights alone are
# more. Move the weights a call does not need out of the checkout first, and back after:
#
#   bench/device_tree.sh aside [DRAFT...]   drafts/*/model.safetensors out to $STASH, but those of DRAFT
#   bench/device_tree.sh back               everything in $STASH back in place
#   bench/device_tree.sh size               the bytes that would travel (tracked + untracked, not ignored)
#
# Never commit while weights are aside (git sees them deleted). ROOT (default: this checkout) and STASH
# (default /tmp/specsplit-aside) can be set.
set -euo pipefail
ROOT=${ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
STASH=${STASH:-/tmp/specsplit-aside}
cd "$ROOT"

size() {
  { git ls-files -z --cached --others --exclude-standard 2>/dev/null || find . -type f -print0; } \
    | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {printf "%d bytes (%.1f MiB) would travel\n", s, s / 1048576}'
}

case ${1:-} in
  aside)
    shift
    for f in drafts/*/model.safetensors; do
      [[ -e $f ]] || continue
      name=${f#drafts/}
      name=${name%%/*}
      [[ " $* " == *" $name "* ]] && continue
      mkdir -p "$STASH/$(dirname "$f")"
      mv "$f" "$STASH/$f"
      echo "aside: $f"
    done
    size
    ;;
  back)
    [[ -d $STASH/drafts ]] || { echo "nothing aside in $STASH"; exit 0; }
    (cd "$STASH" && find drafts -type f) | while read -r f; do
      mkdir -p "$(dirname "$f")"
      mv "$STASH/$f" "$f"
      echo "back: $f"
    done
    ;;
  size) size ;;
  *)
    sed -n '2,10p' "$0" | cut -c3-
    exit 2
    ;;
esac
