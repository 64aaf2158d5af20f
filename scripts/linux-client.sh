#!/usr/bin/env bash
# Boot the small Linux kernel under Lucid and check what Linux's own drivers do with Lucid's
# devices (the same boot as the CI test `small_linux_drives_lucid_devices_on_*`):
#
#   scripts/linux-client.sh [--rung L0|L1|L2|L3|L4|L4p] [--iommu vtd[,mode=..][,pin=..]]
#                           [lucid-linux-client options]
#
# Builds lucid and lucid-linux-client (release), builds the kernel with scripts/linux-guest.sh
# when it is missing (about 10 minutes, once per machine), then runs the checks. The last line
# printed is
#
#   linux-client: init=yes|no rootfs=ok|fail disk2=ok|fail net=ok|fail|skipped
#                 userspace=ok|fail|skipped virtiofs_root=ok|fail|skipped
#                 vhost_user_blk=ok|fail|skipped assigned_blk=ok|fail vsock=ok|fail rng=ok|fail seconds=N   (one line)
#
# (disk2: the GPT disk; each device's check includes MSI-X interrupts, none on INTx, from Lucid's
# counters; with --iommu the line has `iommu=ok|fail` after net: Linux parsed the DMAR, intel-iommu
# took the unit, no DMA fault, translations counted; rng: hw_random read virtio-rng; vsock: Linux's
# virtio_vsock reset a host CONNECT to an unused port; virtiofs_root and vhost_user_blk: the kernel
# booted from a root served by virtiofsd and by qemu-storage-daemon, and its init verified its own
# bytes; those two need qemu-system-common and are skipped with --iommu or --vhost-user no) and
# the exit status is 0 when nothing failed. The network checks need root (a network
# namespace with a tap); the userspace checks need a VT-x/AMD-V host. Other options go to
# lucid-linux-client: --timeout SECS, --json FILE, --log FILE, --net auto|yes|no,
# --userspace auto|yes|no, --vhost-user auto|yes|no, -- extra `lucid run` arguments. The console log with times goes to
# work-linux/linux-client-RUNG.log (linux-client-RUNG-iommu.log with --iommu) unless --log says
# otherwise. On a shared machine, run the
# polling rungs (L4, L4p) under `flock /tmp/lucid-quiet.lock`.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wl="${LUCID_LINUX_DIR:-$repo_root/work-linux}"
rung=L1
tag=
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rung) rung="${2:?--rung needs a value}"; shift ;;
        --iommu) args+=(--iommu "${2:?--iommu needs a value}"); tag=-iommu; shift ;;
        --) args+=("$@"); break ;;
        *) args+=("$1") ;;
    esac
    shift
done

cd "$repo_root"
cargo build --release -q -p lucid -p lucid-linux-client
if [ ! -e "$wl/small/vmlinux" ]; then
    echo "linux-client: no kernel in $wl/small: building it (scripts/linux-guest.sh)" >&2
    scripts/linux-guest.sh "$wl" >/dev/null
fi
has_log=0
for a in "${args[@]+"${args[@]}"}"; do [ "$a" = --log ] && has_log=1; done
if [ "$has_log" = 0 ]; then args=(--log "$wl/linux-client-$rung$tag.log" "${args[@]+"${args[@]}"}"); fi
exec target/release/lucid-linux-client --kernel "$wl/small/vmlinux" \
    --lucid target/release/lucid --rung "$rung" "${args[@]+"${args[@]}"}"
