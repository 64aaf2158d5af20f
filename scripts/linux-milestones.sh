#!/usr/bin/env bash
# Boot Linux under Lucid (or QEMU, for comparison) and timestamp every serial line.
#
#   scripts/linux-milestones.sh [--qemu] [--timeout SECS] [--out LOG] [-- extra lucid run args]
#
# Uses work-linux/ (see scripts/linux-guest.sh) and target/release/lucid (override with $LUCID).
# Writes LOG (default work-linux/boot-lucid.log or boot-qemu.log) with one line per serial line,
# prefixed by the seconds since the VMM was started, then prints the milestone table.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wl="${LUCID_LINUX_DIR:-$repo_root/work-linux}"
vmm=lucid
timeout_s=600
out=""
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --qemu) vmm=qemu ;;
        --timeout) timeout_s="$2"; shift ;;
        --out) out="$2"; shift ;;
        --) shift; extra=("$@"); break ;;
        *) echo "usage: $0 [--qemu] [--timeout SECS] [--out LOG] [-- extra args]" >&2; exit 2 ;;
    esac
    shift
done
out="${out:-$wl/boot-$vmm.log}"
for f in vmlinux initramfs.cpio.gz; do
    [ -s "$wl/$f" ] || { echo "missing $wl/$f: run scripts/linux-guest.sh" >&2; exit 1; }
done

if [ "$vmm" = lucid ]; then
    bin="${LUCID:-$repo_root/target/release/lucid}"
    [ -x "$bin" ] || { echo "missing $bin: cargo build --release -p lucid" >&2; exit 1; }
    cmd=("$bin" run --kernel "${LUCID_KERNEL:-$wl/vmlinux}" --initrd "$wl/initramfs.cpio.gz" --memory 256
        --stats-json "${out%.log}.stats.json" "${extra[@]+"${extra[@]}"}")
else
    cmd=(qemu-system-x86_64 -M microvm,x-option-roms=off,rtc=off -enable-kvm -m 256 -nographic
        -no-reboot -kernel "${LUCID_KERNEL:-$wl/vmlinux}" -initrd "$wl/initramfs.cpio.gz"
        -append "console=ttyS0 earlyprintk=serial reboot=k panic=-1 noxsave clearcpuid=141,154,156"
        "${extra[@]+"${extra[@]}"}")
fi

echo "# ${cmd[*]}" >"$out"
start="$EPOCHREALTIME"
stamp() {
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        line="${line%$'\r'}"
        printf '%8.3f %s\n' "$(bc_sub "$EPOCHREALTIME" "$start")" "$line"
    done
}
# Seconds elapsed, from two $EPOCHREALTIME values, without bc.
bc_sub() {
    local a="${1/./}" b="${2/./}"
    local d=$((10#$a - 10#$b))
    printf '%d.%06d' $((d / 1000000)) $((d % 1000000))
}
set +e
timeout --signal=TERM --kill-after=10 "$timeout_s" "${cmd[@]}" </dev/null 2>&1 | stamp >>"$out"
rc="${PIPESTATUS[0]}"
set -e
printf '%8.3f [exit status %s]\n' "$(bc_sub "$EPOCHREALTIME" "$start")" "$rc" >>"$out"

# Milestones: first line matching each pattern.
milestones=(
    "Linux version"
    "BIOS-e820:|e820: "
    "Booting paravirtualized kernel"
    "setup_percpu:"
    "Memory: "
    "rcu: "
    "ACPI: Core revision"
    "LUCID"
    "printk: console \[ttyS0\] enabled"
    "x2apic"
    "Freeing unused kernel image"
    "lucid-initramfs: userspace reached"
)
echo "milestone | seconds"
echo "---|---"
for m in "${milestones[@]}"; do
    t="$(grep -E -m1 -- "$m" "$out" | awk '{print $1}' || true)"
    echo "$m | ${t:--}"
done
echo "last lines:"
tail -n 8 "$out"
