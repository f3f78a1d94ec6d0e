#!/usr/bin/env bash
# Before/after check of the snapshot reader: runs the `snapshot_outputs` example of one build over
# snapshot files and writes one line per file (sha256 of the decoded model, summary, top sites, JSON
# and HTML, or of the error message) to OUT; run it with the old and the new build and `diff` the two.
#
#   cargo build --release -p torchmem-snapshot --example snapshot_outputs
#   cp target/release/examples/snapshot_outputs /tmp/outputs_before     # at the old commit
#   bench/snapshot/compare_outputs.sh /tmp/outputs_before /tmp/before.txt FILES...
#   bench/snapshot/compare_outputs.sh target/release/examples/snapshot_outputs /tmp/after.txt FILES...
#   diff /tmp/before.txt /tmp/after.txt && echo identical
#
# FILES may be directories (every regular file under them: the fuzz corpus and seeds are good inputs,
# since most of them are damaged or odd pickles that exercise the fallback and the error messages).
set -euo pipefail
bin=$1
out=$2
shift 2
: >"$out"
for arg in "$@"; do
    if [[ -d $arg ]]; then
        find "$arg" -type f | sort
    else
        echo "$arg"
    fi
done | while read -r f; do
    sum=$("$bin" "$f" | sha256sum | cut -d' ' -f1)
    echo "$sum $f" >>"$out"
done
wc -l <"$out"
