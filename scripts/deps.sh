#!/usr/bin/env bash
# Installs what Lucid needs on a fresh Debian machine (as root): a C toolchain for the probe-guest
# kit, and with --test also QEMU (the peer the probe guests are checked against) and the tools
# the Linux guest script and tests use; with --fuzz what scripts/fuzz.sh needs. Idempotent and
# quiet when everything is there.
set -euo pipefail
want=(gcc make)
if [[ "${1:-}" == "--test" || "${1:-}" == "--fuzz" ]]; then
  # The fuzz targets link libFuzzer, which is C++ (the tests check that the targets build).
  want+=(g++)
fi
if [[ "${1:-}" == "--test" ]]; then
  want+=(qemu-system-x86 busybox-static lz4 cpio iproute2 curl)
  # The small Linux guest: its source and build tools, and mke2fs for the test's root disk.
  want+=(linux-source-6.1 flex bison bc libelf-dev e2fsprogs)
fi
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "deps: cargo not found: install Rust (rustup) first" >&2; exit 1; }
