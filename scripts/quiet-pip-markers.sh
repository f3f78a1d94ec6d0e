#!/usr/bin/env bash
# A filter (stdin -> stdout) for build output: drops pip's "Ignoring X: markers 'extra == "…"' don't match your
# environment" lines (one per optional dependency of torchmem, printed by `maturin develop`), keeps every other
# line. Exits 0 whatever it dropped. Used by scripts/dev-env.sh.
grep -v -E "^Ignoring [^ ]+: markers '.*' don't match your environment$" || true
