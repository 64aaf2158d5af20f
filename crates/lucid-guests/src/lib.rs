//! The probe-guest kit: small freestanding PVH guests (C, built from `guests/` by build.rs with gcc) embedded as ELF images, plus the host twin of the `compute` guest.
//!
//! Every guest boots through the PVH entry note (so the same image runs under
//! Lucid and `qemu-system-x86_64 -M microvm -kernel`), drops to CPL3 with
//! the TSS I/O bitmap open, prints `key=value` lines on COM1 and exits by
//! writing its code to port 0xf4 (process status `(code << 1) | 1`).
//! Parameters come from the kernel command line (`count=100 port=0x80`).
//! See `guests/README.md` for the ABI and each guest's parameters and output.

use std::path::{Path, PathBuf};
use std::process::Command;

pub mod pagecache;

macro_rules! guests {
    ($($name:literal),* $(,)?) => {
        /// Names of the embedded guests, as accepted by [`get`].
        pub const NAMES: &[&str] = &[$($name),*];

        /// The ELF image of the guest called `name`, or `None`.
        pub fn get(name: &str) -> Option<&'static [u8]> {
            match name {
                $($name => Some(include_bytes!(concat!(env!("OUT_DIR"), "/guests/", $name, ".elf"))),)*
                _ => None,
            }
        }
    };
}

guests!(
    "hello",
    "compute",
    "pio-ping",
    "mmio-ping",
    "memtouch",
    "smp",
    "hostinfo",
    "irq-self",
    "triplefault",
    "garbage",
    "spin",
    "pci-scan",
    "virtio-blk",
    "virtio-net",
    "virtio-evil",
    "pagecache",
    "pvh-ttext",
    "mb-lowmem",
    "acpi-pm",
    "cpl0-insns",
    "kvm-hypercall",
    "edu",
    "iommu",
    "vtd-regs",
    "vtd-evil",
    "balloon",
    "stream",
    "cpu",
    "noise",
    "sym-spy",
    "sym-call",
    "sym-swap",
    "sym-mod",
    "hotplug",
    "virtio-rng",
    "fw-cfg",
    "virtio-console",
    "virtio-fs",
    "virtio-vsock",
);

/// Symbiotic modules (docs/symbiotic.md §7): ELF64 relocatable objects built with
/// `gcc -c` from `guests/modules/<name>.c`, loaded into a running `sym-mod` guest. `hello`
/// `counter` and `quiet` (no console output: the benchmark's) are good; `badrel` (a GOT relocation), `nosym` (calls a symbol the guest does
/// not export) and `bigbss` (a 64 MiB .bss) are refused.
pub const MODULE_NAMES: &[&str] = &["hello", "counter", "quiet", "badrel", "nosym", "bigbss"];

/// The object file of module `name`, or `None`.
pub fn module(name: &str) -> Option<&'static [u8]> {
    macro_rules! m {
        ($($n:literal),*) => {
            match name {
                $($n => Some(include_bytes!(concat!(env!("OUT_DIR"), "/guests/modules/", $n, ".o")) as &[u8]),)*
                _ => None,
            }
        };
    }
    m!("hello", "counter", "quiet", "badrel", "nosym", "bigbss")
}

/// Guests that boot through multiboot (32-bit ELF) rather than the PVH note.
pub const MULTIBOOT: &[&str] = &["mb-lowmem"];

/// The guest `lucid run` boots when none is named.
pub const DEFAULT: &str = "hostinfo";

/// Exit code a guest reports after an unexpected CPU exception (status 253).
pub const EXIT_EXCEPTION: u32 = 0x7e;

/// Process exit status QEMU's isa-debug-exit (and Lucid) give for guest exit `code`.
pub const fn exit_status(code: u32) -> u32 {
    (code << 1) | 1
}

/// Path of the host build of the `compute` kernel (`compute-host [iters=N]`),
/// which prints the same `checksum=` line as the `compute` guest.
pub fn compute_host_path() -> PathBuf {
    PathBuf::from(concat!(env!("OUT_DIR"), "/guests/compute-host"))
}

/// Path of the host twin of the pools workloads (`noise-host [mode=noise|cpu] [cpu=N] ...`):
/// the `noise` guest's loop and the `cpu` guest's passes run natively, same output lines.
pub fn noise_host_path() -> PathBuf {
    PathBuf::from(concat!(env!("OUT_DIR"), "/guests/noise-host"))
}

/// Directory holding the built guest ELF files (`<name>.elf`).
pub fn build_dir() -> PathBuf {
    PathBuf::from(concat!(env!("OUT_DIR"), "/guests"))
}

/// Writes every built-in guest to `dir` (created if missing) as `<name>.elf`, the image
/// `lucid run --guest <name>` boots, so a client of the API or another VMM can boot it by path.
/// Returns the files written, in [`NAMES`] order.
pub fn write_all(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    NAMES
        .iter()
        .map(|name| {
            let path = dir.join(format!("{name}.elf"));
            std::fs::write(&path, get(name).expect("a name of NAMES"))?;
            Ok(path)
        })
        .collect()
}

/// QEMU's microvm without option ROMs: boots a PVH ELF directly (~0.1 s).
pub const QEMU_MICROVM: &[&str] = &["-M", "microvm,x-option-roms=off,rtc=off,isa-serial=on"];
/// q35 with qboot: port 0xCF8 configuration works, QEMU's ACPI tables (ICH9 PM at 0x600), and it
/// boots in a fraction of a second.
pub const QEMU_Q35: &[&str] = &["-M", "q35", "-bios", "/usr/share/qemu/qboot.rom"];

/// Whether the tests run in CI (`CI=true`, as `.ci/run` sets; any value but empty, `0` or
/// `false`): there every host capability a test needs is expected, so [`skip_or_fail`] fails.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// For a test that cannot run on this host for `reason` (a missing capability: root, a cgroup
/// controller, QEMU, ...): says so on stderr and returns, the caller then returns and passes;
/// under CI ([`in_ci`]) it panics instead, so that a CI run never passes a test that did not run.
#[track_caller]
pub fn skip_or_fail(reason: &str) {
    assert!(
        !in_ci(),
        "this test cannot run here, which CI does not allow: {reason}"
    );
    eprintln!("skipped: {reason}");
}

/// For tests that compare with QEMU: whether `qemu-system-x86_64` runs; if not, the test skips
/// (or, in CI, fails: see [`skip_or_fail`]).
pub fn qemu_installed() -> bool {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok()
    {
        return true;
    }
    skip_or_fail("qemu-system-x86_64 is not installed (scripts/deps.sh --test installs it)");
    false
}

/// QEMU running a probe guest: one vCPU, 256 MiB, serial on stdout, the debug-exit port, no
/// default devices. `machine` is the `-M` option and its value (plus `-bios` for q35). The
/// default CPU model: `-cpu host` aborts on this host (MSR 0x10a). Standard input and error are
/// the caller's to set.
pub fn qemu_command(machine: &[&str], kernel: &Path, append: &str) -> Command {
    let mut c = Command::new("qemu-system-x86_64");
    c.args(machine).args([
        "-enable-kvm",
        "-m",
        "256",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-display",
        "none",
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=4",
    ]);
    c.arg("-kernel").arg(kernel).args(["-append", append]);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_guest_is_a_pvh_elf() {
        for name in NAMES.iter().filter(|n| !MULTIBOOT.contains(n)) {
            let elf = get(name).unwrap();
            assert_eq!(&elf[..4], b"\x7fELF", "{name}");
            assert_eq!(elf[4], 2, "{name}: ELF64");
            // the PVH note: namesz 4, descsz 4, type 18, "Xen\0"
            let note = [4u8, 0, 0, 0, 4, 0, 0, 0, 18, 0, 0, 0, b'X', b'e', b'n', 0];
            assert!(
                elf.windows(note.len()).any(|w| w == note),
                "{name}: PVH note"
            );
        }
        for name in MULTIBOOT {
            let elf = get(name).unwrap();
            assert_eq!(&elf[..4], b"\x7fELF", "{name}");
            assert_eq!(elf[4], 1, "{name}: ELF32, as QEMU wants for multiboot");
            let magic = 0x1BAD_B002u32.to_le_bytes();
            let at = elf
                .windows(4)
                .position(|w| w == magic)
                .expect("multiboot header");
            assert!(at < 8192, "{name}: multiboot header in the first 8 KiB");
        }
        assert!(get("no-such-guest").is_none());
        assert!(NAMES.contains(&DEFAULT));
    }

    #[test]
    fn compute_host_runs() {
        let out = std::process::Command::new(compute_host_path())
            .arg("iters=1000")
            .output()
            .unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("checksum=0x"), "{text}");
    }
}
