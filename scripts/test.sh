#!/usr/bin/env bash
# Lucid's tests: installs what they need, fetches the Linux guest, checks style, then runs every
# test on real KVM. Needs root (for /dev/kvm, apt and network namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh --test
if [[ -x scripts/linux-guest.sh ]]; then
  scripts/linux-guest.sh work-linux
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo build --workspace --release -q
# The fuzz targets (their own workspace, run by scripts/fuzz.sh) must keep building.
cargo check -q --manifest-path fuzz/Cargo.toml
# Every fuzz target for a few seconds from its seeds (fuzz.sh installs nightly and cargo-fuzz).
scripts/fuzz.sh 5
cargo test --workspace --release -- --test-threads=2
