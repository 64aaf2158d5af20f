#!/usr/bin/env bash
# Lucid's main job: builds Lucid (and its probe-guest kit) and runs `lucid run` with the given
# arguments. With none, Lucid boots its built-in probe guest, which reports what this host can do.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release -q -p lucid
exec target/release/lucid run "$@"
