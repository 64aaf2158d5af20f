#!/usr/bin/env bash
# Fetch a Debian cloud kernel, build a small kernel from Debian's kernel source, and build a
# busybox initramfs, for booting Linux under Lucid.
#
#   scripts/linux-guest.sh [OUTDIR]        (default: work-linux/ in the repository root)
#
# Outputs:
#   OUTDIR/bzImage, OUTDIR/vmlinux   the distribution's cloud kernel (ELF with a PVH note,
#                                    extracted from the bzImage's LZ4 payload)
#   OUTDIR/initramfs.cpio.gz         busybox initramfs for it
#   OUTDIR/small/vmlinux             the small kernel: `make tinyconfig` on linux-source-6.1 plus
#                                    guests/linux/lucid.config (a symlink into the cache below)
# Idempotent: existing, valid outputs are kept. Needs root (apt-get) on Debian 12, or the tools
# already installed.
#
# The small kernel is cached outside the checkout, in
# $LUCID_LINUX_CACHE/<source version>-<fragment hash>/ (default /var/cache/lucid/linux, or
# ~/.cache/lucid/linux when that is not writable), so a machine builds it once per source
# version and fragment. The build takes about 10 minutes on 2 cores; it runs under `nice`.
#
# Environment:
#   LUCID_KERNEL_PKG   Debian package to use (default: what linux-image-cloud-amd64 depends on,
#                      i.e. the newest 6.1 cloud kernel of the release)
#   LUCID_LINUX_CACHE  where small kernels are cached (see above)
#   LUCID_NO_SMALL=1   skip the small kernel
#   LUCID_FORCE=1      rebuild everything (the small kernel too)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
outdir="${1:-$repo_root/work-linux}"
mkdir -p "$outdir"
outdir="$(cd "$outdir" && pwd)"
force="${LUCID_FORCE:-0}"

log() { echo "linux-guest: $*" >&2; }

need_tools=()
# busybox-static provides a static /bin/busybox; a dynamic busybox would not run in the initramfs.
if [ ! -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; then need_tools+=(busybox-static); fi
command -v lz4 >/dev/null 2>&1 || need_tools+=(lz4)
command -v cpio >/dev/null 2>&1 || need_tools+=(cpio)
command -v readelf >/dev/null 2>&1 || need_tools+=(binutils)
command -v gzip >/dev/null 2>&1 || need_tools+=(gzip)
if [ "${LUCID_NO_SMALL:-0}" != 1 ]; then
    # What building the small kernel from Debian's source package takes.
    [ -e /usr/src/linux-source-6.1.tar.xz ] || need_tools+=(linux-source-6.1)
    for t in gcc make flex bison bc xz; do
        command -v "$t" >/dev/null 2>&1 || need_tools+=("${t/xz/xz-utils}")
    done
    [ -e /usr/include/libelf.h ] || need_tools+=(libelf-dev)
fi
# Deduplicate.
mapfile -t need_tools < <(printf '%s\n' "${need_tools[@]+"${need_tools[@]}"}" | sed '/^$/d' | sort -u)

apt_updated=0
apt_update() {
    if [ "$apt_updated" = 0 ]; then
        log "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        apt_updated=1
    fi
}
apt_sudo() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ "${#need_tools[@]}" -gt 0 ]; then
    log "installing ${need_tools[*]}"
    if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null; then
        log "need root to install ${need_tools[*]}"; exit 1
    fi
    apt_sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
    apt_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_tools[@]}" >/dev/null
fi

# ---------------------------------------------------------------------------------------------
# Kernel package
# ---------------------------------------------------------------------------------------------
pick_kernel_pkg() {
    local pkg
    pkg="$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
        awk '/Depends: linux-image-.*-cloud-amd64$/ {print $2; exit}')"
    if [ -z "$pkg" ]; then
        # Fall back to the newest versioned 6.1 cloud image in the package lists.
        pkg="$(apt-cache search --names-only '^linux-image-[0-9].*-cloud-amd64$' 2>/dev/null |
            awk '{print $1}' | sort -V | tail -n1)"
    fi
    echo "$pkg"
}

kernel_ok() { [ -s "$outdir/bzImage" ] && [ "$force" != 1 ]; }

if ! kernel_ok; then
    pkg="${LUCID_KERNEL_PKG:-}"
    if [ -z "$pkg" ]; then
        pkg="$(pick_kernel_pkg)"
        if [ -z "$pkg" ]; then
            apt_update
            pkg="$(pick_kernel_pkg)"
        fi
    fi
    [ -n "$pkg" ] || { log "no linux-image-*-cloud-amd64 package found"; exit 1; }
    log "kernel package: $pkg"
    dl="$outdir/deb"
    rm -rf "$dl"; mkdir -p "$dl"
    if ! (cd "$dl" && apt-get download -q "$pkg" >/dev/null 2>&1); then
        apt_update
        (cd "$dl" && apt-get download -q "$pkg" >/dev/null)
    fi
    deb="$(ls "$dl"/*.deb | head -n1)"
    dpkg-deb -x "$deb" "$dl/root"
    vmlinuz="$(ls "$dl"/root/boot/vmlinuz-* | head -n1)"
    cp "$vmlinuz" "$outdir/bzImage.tmp"
    mv "$outdir/bzImage.tmp" "$outdir/bzImage"
    basename "$vmlinuz" | sed 's/^vmlinuz-//' >"$outdir/kernel-version"
    rm -rf "$dl"
    rm -f "$outdir/vmlinux"
fi

# ---------------------------------------------------------------------------------------------
# vmlinux from the bzImage's LZ4 payload
# ---------------------------------------------------------------------------------------------
has_pvh_note() { readelf -n "$1" 2>/dev/null | grep -q 'Xen.*0x00000012'; }

vmlinux_ok() {
    [ -s "$outdir/vmlinux" ] && [ "$force" != 1 ] && has_pvh_note "$outdir/vmlinux"
}

if ! vmlinux_ok; then
    # Offsets of the LZ4 frame magics: legacy 02 21 4c 18 and modern 04 22 4d 18.
    offsets="$(LC_ALL=C grep -obaP '\x02\x21\x4c\x18|\x04\x22\x4d\x18' "$outdir/bzImage" |
        cut -d: -f1 || true)"
    [ -n "$offsets" ] || { log "no LZ4 frame found in $outdir/bzImage"; exit 1; }
    found=0
    for off in $offsets; do
        tmp="$outdir/vmlinux.tmp"
        # lz4 -d reads the frame and stops at trailing garbage (exit status may be non-zero).
        tail -c +"$((off + 1))" "$outdir/bzImage" | lz4 -d -c 2>/dev/null >"$tmp" || true
        if [ -s "$tmp" ] && [ "$(head -c 4 "$tmp" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ] &&
            has_pvh_note "$tmp"; then
            mv "$tmp" "$outdir/vmlinux"
            found=1
            break
        fi
        rm -f "$tmp"
    done
    [ "$found" = 1 ] || { log "no ELF vmlinux with a PVH note in the LZ4 payload"; exit 1; }
fi

# ---------------------------------------------------------------------------------------------
# busybox initramfs
# ---------------------------------------------------------------------------------------------
initramfs_ok() { [ -s "$outdir/initramfs.cpio.gz" ] && [ "$force" != 1 ]; }

if ! initramfs_ok; then
    bb=/bin/busybox
    [ -x "$bb" ] || bb="$(command -v busybox)"
    if ldd "$bb" >/dev/null 2>&1; then
        log "$bb is dynamically linked; install busybox-static"; exit 1
    fi
    rootfs="$outdir/initramfs.root"
    rm -rf "$rootfs"
    mkdir -p "$rootfs"/{bin,sbin,proc,sys,dev,tmp,etc,root}
    cp "$bb" "$rootfs/bin/busybox"
    for applet in sh mount umount echo cat ls uname poweroff reboot halt sleep dmesg mkdir; do
        ln -s busybox "$rootfs/bin/$applet"
    done
    cat >"$rootfs/init" <<'EOF'
#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev 2>/dev/null
echo "lucid-initramfs: userspace reached ($(/bin/busybox uname -r))"
/bin/busybox cat /proc/uptime
/bin/busybox poweroff -f
/bin/busybox reboot -f
EOF
    chmod +x "$rootfs/init"
    # Console device node so that /init has a stdout even before devtmpfs is mounted.
    if [ "$(id -u)" = 0 ]; then
        mknod -m 600 "$rootfs/dev/console" c 5 1 2>/dev/null || true
    fi
    (cd "$rootfs" && find . -print0 | LC_ALL=C sort -z |
        cpio --null -o -H newc --owner 0:0 --quiet) | gzip -9 >"$outdir/initramfs.cpio.gz.tmp"
    mv "$outdir/initramfs.cpio.gz.tmp" "$outdir/initramfs.cpio.gz"
    rm -rf "$rootfs"
fi

# ---------------------------------------------------------------------------------------------
# The small kernel: tinyconfig + guests/linux/lucid.config, cached by source version + fragment
# ---------------------------------------------------------------------------------------------
build_small_kernel() {
    local src_tar=/usr/src/linux-source-6.1.tar.xz fragment="$repo_root/guests/linux/lucid.config"
    local srcver hash cache key dir src build
    srcver="$(dpkg-query -W -f='${Version}' linux-source-6.1 2>/dev/null || true)"
    [ -n "$srcver" ] || srcver="$(stat -c %s-%Y "$src_tar")"
    hash="$(sha256sum "$fragment" | cut -c1-12)"
    cache="${LUCID_LINUX_CACHE:-}"
    if [ -z "$cache" ]; then
        cache=/var/cache/lucid/linux
        if ! mkdir -p "$cache" 2>/dev/null || [ ! -w "$cache" ]; then
            cache="${XDG_CACHE_HOME:-$HOME/.cache}/lucid/linux"
        fi
    fi
    key="$srcver-$hash"
    dir="$cache/$key"
    mkdir -p "$outdir/small"
    if [ -s "$dir/vmlinux" ] && [ "$force" != 1 ] && has_pvh_note "$dir/vmlinux"; then
        ln -sfn "$dir/vmlinux" "$outdir/small/vmlinux"
        ln -sfn "$dir/config" "$outdir/small/config"
        echo "$key" >"$outdir/small/key"
        return
    fi
    mkdir -p "$dir"
    # One unpacked source tree per source version, shared by every fragment.
    src="$cache/src-$srcver"
    if [ ! -e "$src/.lucid-unpacked" ]; then
        log "unpacking $src_tar into $src"
        rm -rf "$src" "$src.tmp"
        mkdir -p "$src.tmp"
        tar -xJf "$src_tar" -C "$src.tmp" --strip-components=1
        touch "$src.tmp/.lucid-unpacked"
        mv "$src.tmp" "$src"
    fi
    build="$dir/build"
    rm -rf "$build"
    mkdir -p "$build"
    log "building the small kernel ($key) in $build; log: $dir/build.log"
    # Fixed build identity, so that the same source and fragment give the same banner.
    local kmake=(nice -n 10 make -C "$src" O="$build" ARCH=x86_64 -j"$(nproc)"
        KBUILD_BUILD_USER=lucid KBUILD_BUILD_HOST=lucid
        KBUILD_BUILD_TIMESTAMP="linux-source $srcver")
    {
        "${kmake[@]}" tinyconfig
        "$src/scripts/kconfig/merge_config.sh" -m -O "$build" "$build/.config" "$fragment"
        "${kmake[@]}" olddefconfig
    } >"$dir/build.log" 2>&1 || { tail -n 30 "$dir/build.log" >&2; log "configuring failed"; exit 1; }
    # Every option the fragment turns on must have survived the dependency resolution.
    local missing
    missing="$(grep -E '^CONFIG_[A-Z0-9_]+=y' "$fragment" | while read -r opt; do
        grep -qxF "$opt" "$build/.config" || echo "$opt"
    done)"
    if [ -n "$missing" ]; then
        log "options of $fragment lost by make olddefconfig (missing dependency?):"
        echo "$missing" >&2
        exit 1
    fi
    # And every option it turns off must be off.
    local kept
    kept="$(sed -n 's/^# \(CONFIG_[A-Z0-9_]*\) is not set$/\1/p' "$fragment" | while read -r opt; do
        if grep -q "^$opt=[ym]" "$build/.config"; then echo "$opt"; fi
    done)"
    if [ -n "$kept" ]; then
        log "options $fragment turns off are still on (selected by another option?):"
        echo "$kept" >&2
        exit 1
    fi
    "${kmake[@]}" vmlinux >>"$dir/build.log" 2>&1 ||
        { tail -n 30 "$dir/build.log" >&2; log "kernel build failed"; exit 1; }
    has_pvh_note "$build/vmlinux" || { log "$build/vmlinux has no PVH note"; exit 1; }
    cp "$build/.config" "$dir/config"
    cp "$build/vmlinux" "$dir/vmlinux.tmp"
    mv "$dir/vmlinux.tmp" "$dir/vmlinux"
    # The objects are not needed again (a new fragment is a new key); the source tree stays.
    rm -rf "$build"
    ln -sfn "$dir/vmlinux" "$outdir/small/vmlinux"
    ln -sfn "$dir/config" "$outdir/small/config"
    echo "$key" >"$outdir/small/key"
    log "small kernel: $dir/vmlinux"
}

if [ "${LUCID_NO_SMALL:-0}" != 1 ]; then
    build_small_kernel
fi

kver="$(cat "$outdir/kernel-version" 2>/dev/null || echo unknown)"
log "kernel $kver"
echo "$outdir/bzImage"
echo "$outdir/vmlinux"
echo "$outdir/initramfs.cpio.gz"
if [ "${LUCID_NO_SMALL:-0}" != 1 ]; then echo "$outdir/small/vmlinux"; fi
