#!/usr/bin/env bash
# Runs Lucid's cargo-fuzz targets (fuzz/fuzz_targets/), one after the other, each for a given time
# or number of executions, and fails if any crashed. scripts/test.sh runs every target briefly;
# longer runs are for finding bugs (the crashes found so far are regression tests there).
#
#   scripts/fuzz.sh [SECONDS | -runs=N] [TARGET...]
#
# SECONDS per target (default 60), or -runs=N executions per target; no TARGET runs them all.
# Each target's working corpus, fuzz/corpus/<target> (not in git), starts from the committed seeds
# in fuzz/seeds/<target> and keeps what the runs add. A crash leaves its input in
# fuzz/artifacts/<target>/; `cargo +nightly fuzz tmin <target> <input>` minimizes it.
# Installs what it needs: the nightly toolchain and cargo-fuzz.
set -euo pipefail
# libFuzzer (libfuzzer-sys) is C++.
"$(dirname "$0")/deps.sh" --fuzz
cd "$(dirname "$0")/../fuzz"

limit="-max_total_time=60"
case "${1:-}" in
  -runs=*) limit="$1"; shift ;;
  ''|*[!0-9]*) ;;
  *) limit="-max_total_time=$1"; shift ;;
esac

export PATH="$HOME/.cargo/bin:$PATH"
if ! rustup toolchain list | grep -q '^nightly'; then
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi

targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

failed=()
summary=()
for t in "${targets[@]}"; do
  if [[ $t == virtio_pci && ! -w /dev/kvm ]]; then
    # In CI (CI=true) every target must run.
    if [[ -n ${CI:-} && $CI != 0 && $CI != false ]]; then
      failed+=("$t")
    fi
    summary+=("$(printf '%-20s %-6s (needs /dev/kvm)' "$t" skipped)")
    echo "${summary[-1]}"
    continue
  fi
  mkdir -p "corpus/$t" "seeds/$t"
  log="$(mktemp)"
  echo "== $t ($limit)"
  nice -n 10 cargo +nightly fuzz build "$t"
  start=$(date +%s)
  if nice -n 10 cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
      "$limit" -print_final_stats=1 >"$log" 2>&1; then
    status=ok
  else
    status=CRASH
    failed+=("$t")
    grep -a -A1 -E "panicked|ERROR: AddressSanitizer|ERROR: libFuzzer|SUMMARY|Test unit written" "$log" | head -20 || true
  fi
  execs=$(grep -a -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  secs=$(( $(date +%s) - start ))
  summary+=("$(printf '%-20s %-6s %12s executions %6s s' "$t" "$status" "${execs:-?}" "$secs")")
  echo "${summary[-1]}"
  rm -f "$log"
done

echo
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "failed: ${failed[*]} (a crash leaves its input in fuzz/artifacts/)" >&2
  exit 1
fi
