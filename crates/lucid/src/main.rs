//! `lucid`: the Lucid VMM's one binary. `lucid run` boots a kernel (or, with no `--kernel`, a
//! built-in probe guest that measures this host), `lucid probe` reports what this host's KVM can
//! do, and `lucid bench` measures Lucid against the KVM floor and QEMU.

mod logger;
mod pools_cmd;
mod sym_cmd;
mod top;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use lucid::rest;
use lucid_vmm::options::{
    BACKING, BALLOON, BLK, CONSOLE_VIRTIO, DEVICE, FS, IOMMU, JAIL, NET, POOL, RNG, SERIAL,
    USER_DEVICE, VSOCK,
};
use lucid_vmm::{
    KernelSource, StopReason, Vm, VmConfig, EXIT_FAILURE, EXIT_USAGE, MAX_MEM_MIB, MAX_VCPUS,
    MIN_MEMORY_LIMIT_MIB, MIN_MEM_MIB,
};

#[derive(Parser)]
#[command(
    name = "lucid",
    version,
    about = "Lucid: a KVM virtual machine monitor"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Only warnings and errors (no summary at VM exit, no notes on what Lucid chose).
    #[arg(short, long, global = true)]
    quiet: bool,
    /// More detail on what Lucid decides and why (-v debug, -vv trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Log level: off, error, warn, info (the default), debug or trace. Overrides -q and -v.
    #[arg(long, global = true, value_name = "LEVEL")]
    log_level: Option<log::LevelFilter>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a kernel, or with no --kernel the built-in host-report probe guest; with
    /// --api-socket, serve Cloud Hypervisor's REST API beside it, or with no --kernel or
    /// --guest wait for vm.create there (docs/api.md).
    Run(Box<RunArgs>),
    /// Report this host's KVM: backend, capabilities, CPUID interception, exit costs.
    Probe {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Fewer iterations (about 0.2 s instead of 2 s).
        #[arg(long)]
        quick: bool,
    },
    /// Benchmarks (not tests): ratios measured side by side in one run.
    Bench {
        #[command(subcommand)]
        what: lucid_bench::BenchCmd,
    },
    /// List the built-in probe guests (usable with `lucid run --guest NAME`).
    Guests {
        /// Write each as DIR/NAME.elf (DIR is created), to boot by path with `--kernel` or
        /// another VMM.
        #[arg(long, value_name = "DIR")]
        write: Option<PathBuf>,
    },
    /// The host's CPU pools (create, show, destroy): see docs/scheduling.md.
    Pools {
        #[command(subcommand)]
        what: pools_cmd::PoolsCmd,
    },
    /// Talk to a running VM through the REST API's lucid.* endpoints (`lucid run
    /// --api-socket`): SymCalls, modules, SymSpy, statistics (docs/api.md, docs/symbiotic.md).
    Sym(sym_cmd::SymArgs),
    /// Every running VMM whose API socket is in the run directory, live, as top shows
    /// processes: exits/s by reason, interrupts/s, I/O per device and its rung (docs/api.md).
    Top(top::TopArgs),
    /// A device in its own process, for a VM's vhost-user front-end or vfio-user client
    /// (docs/devices.md).
    DeviceServer {
        #[command(subcommand)]
        what: DeviceServerKind,
    },
}

/// The device servers: vhost-user back-ends and vfio-user devices.
#[derive(clap::Subcommand)]
enum DeviceServerKind {
    #[command(flatten)]
    VhostUser(lucid_vhost_net::DeviceServerCmd),
    #[command(flatten)]
    VfioUser(lucid_vfio_server::DeviceServerCmd),
}

/// The flags that describe the VM: refused together with `--config`, which describes all of it.
const VM_FLAGS: &[&str] = &[
    "kernel",
    "guest",
    "initrd",
    "cmdline",
    "memory",
    "vcpus",
    "serial",
    "backing",
    "blk",
    "net",
    "iommu",
    "balloon",
    "rng",
    "vsock",
    "device",
    "hotplug",
    "no_seccomp",
    "pool",
    "low_noise",
    "monitor_window_ms",
    "classify_windows",
    "classify_dwell_ms",
    "memory_limit",
    "swap_mode",
    "swap_pager",
    "symbiotic",
    "api_socket",
    "jail",
    "fw_cfg",
    "console_virtio",
    "fs",
    "user_device",
];

#[derive(clap::Args)]
struct RunArgs {
    /// The whole VM as a JSON file (Lucid's VmConfig: what --print-config prints), instead of
    /// the flags that describe the VM; only logging and the --stats-* and --print-config flags
    /// go with it.
    #[arg(long, value_name = "FILE", conflicts_with_all = VM_FLAGS)]
    config: Option<PathBuf>,
    /// Print the VM's configuration (from the flags or --config) as JSON, a valid --config
    /// file, and exit without running it.
    #[arg(long)]
    print_config: bool,
    /// Kernel: PVH ELF, multiboot ELF, Linux bzImage or vmlinux.
    #[arg(long, conflicts_with = "guest")]
    kernel: Option<PathBuf>,
    /// A built-in probe guest (see `lucid guests`); default: hostinfo.
    #[arg(long)]
    guest: Option<String>,
    #[arg(long)]
    initrd: Option<PathBuf>,
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(MIN_MEM_MIB..=MAX_MEM_MIB))]
    memory: u64,
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=i64::from(MAX_VCPUS)))]
    vcpus: u8,
    #[arg(long, default_value = "stdio", value_name = "OUTPUT", help = SERIAL.help())]
    serial: String,
    #[arg(long, default_value = "anon", help = BACKING.help())]
    backing: String,
    /// Write the run's statistics as JSON to this file.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Write the run's counters in the Prometheus text format to this file at VM exit.
    #[arg(long, value_name = "FILE")]
    stats_prom: Option<PathBuf>,
    #[arg(long = "blk", value_name = "OPTS", help = BLK.help())]
    blk: Vec<String>,
    #[arg(long = "net", value_name = "OPTS", help = NET.help())]
    net: Vec<String>,
    #[arg(long, value_name = "OPTS", help = IOMMU.help())]
    iommu: Option<String>,
    #[arg(long, value_name = "OPTS", help = BALLOON.help())]
    balloon: Option<String>,
    #[arg(long, value_name = "OPTS", num_args = 0..=1, default_missing_value = "", help = RNG.help())]
    rng: Option<String>,
    #[arg(long = "fs", value_name = "OPTS", help = FS.help())]
    fs: Vec<String>,
    #[arg(long, value_name = "OPTS", help = VSOCK.help())]
    vsock: Vec<String>,
    #[arg(long = "user-device", value_name = "OPTS", help = USER_DEVICE.help())]
    user_device: Vec<String>,
    #[arg(long = "device", value_name = "NAME", help = DEVICE.help())]
    device: Vec<String>,
    /// ACPI PCI hotplug and the ACPI power button (docs/api.md); a VM made through the REST
    /// API always has them.
    #[arg(long)]
    hotplug: bool,
    /// QEMU's fw_cfg at ports 0x510-0x51b with its ACPI device (docs/devices.md); on unless off.
    #[arg(long = "fw-cfg", value_name = "on|off", value_parser = ["on", "off"])]
    fw_cfg: Option<String>,
    #[arg(long = "console-virtio", value_name = "OUTPUT", help = CONSOLE_VIRTIO.help())]
    console_virtio: Option<String>,
    /// Run without the per-thread seccomp filters (see docs/security.md).
    #[arg(long)]
    no_seccomp: bool,
    #[arg(long, default_value = "auto", value_name = "NAME|auto|none", help = POOL.help())]
    pool: String,
    /// vCPU threads pinned one per CPU (the highest CPUs), everything else on the other CPUs,
    /// no monitor and no periodic work in Lucid.
    #[arg(long)]
    low_noise: bool,
    /// The pools' monitor window in ms (tests shorten it).
    #[arg(long, default_value_t = 1000, hide = true,
          value_parser = clap::value_parser!(u64).range(10..))]
    monitor_window_ms: u64,
    /// Windows in a row that must agree before the classifier moves the VM.
    #[arg(long, default_value_t = 5, hide = true,
          value_parser = clap::value_parser!(u32).range(1..))]
    classify_windows: u32,
    /// Least time in ms between two moves of the VM.
    #[arg(long, default_value_t = 10_000, hide = true)]
    classify_dwell_ms: u64,
    /// Host memory the VM may use, in MiB (a memory cgroup with host swap behind it; the guest
    /// still has --memory). Needs root, the memory controller and some swap.
    #[arg(long, value_name = "MiB",
          value_parser = clap::value_parser!(u64).range(MIN_MEMORY_LIMIT_MIB..))]
    memory_limit: Option<u64>,
    /// How the VM is swapped over its limit: baseline (plain host swap), mapper (pages read from
    /// virtio-blk stay tied to their disk blocks) or vswapper (mapper plus false-read
    /// prevention). mapper and vswapper need bs=4096 on every --blk.
    #[arg(long, value_name = "MODE", default_value = "baseline")]
    swap_mode: lucid_vmm::SwapMode,
    /// With --memory-limit: on (default) keeps usage under the limit with Lucid's own pager
    /// (MADV_PAGEOUT; needed where the kernel's limit reclaim OOM-kills a VM, e.g. PVM hosts);
    /// off leaves reclaim to the kernel.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = ["on", "off"])]
    swap_pager: String,
    /// Offer the symbiotic interfaces to the guest: discovery, SymSpy pages, SymCall upcalls,
    /// SwapBypass and modules (docs/symbiotic.md).
    #[arg(long)]
    symbiotic: bool,
    /// Serve Cloud Hypervisor's REST API on this Unix socket (docs/api.md), with Lucid's own
    /// endpoints (`lucid sym --socket PATH ...`); `auto`: `lucid-<pid>.sock` in the run
    /// directory `lucid top` reads (`lucid top --help`). With --kernel or --guest the VM boots at once
    /// and the API serves it; with neither it waits for vm.create. A stale socket file is
    /// replaced; one another process listens on is refused.
    #[arg(long, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    #[arg(long, value_name = "OPTS", help = JAIL.help())]
    jail: Option<String>,
}

/// What the CLI could not do, for its one error line.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("no built-in guest {0:?}; built-in guests: {list}", list = lucid_guests::NAMES.join(", "))]
    NoGuest(String),
    #[error(transparent)]
    Device(#[from] lucid_vmm::DeviceOptionError),
    #[error(transparent)]
    Config(#[from] lucid_vmm::ConfigError),
    #[error("cannot read --config {path}")]
    ConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--config {path} is not a VM configuration Lucid reads")]
    ConfigJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("--config {path}: {source}")]
    ConfigCh {
        path: PathBuf,
        #[source]
        source: rest::config::Refusal,
    },
    #[error("cannot write {flag} {path}")]
    StatsFile {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Vmm(#[from] lucid_vmm::VmmError),
    #[error(transparent)]
    Pools(#[from] lucid_vmm::PoolsError),
    #[error(transparent)]
    Probe(#[from] lucid_probe::ProbeError),
    #[error("{0}")]
    Bench(String),
    #[error("{0}")]
    PoolsCmd(String),
    #[error("{0}")]
    Sym(String),
    #[error("cannot write the guests to {dir}")]
    GuestsWrite {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Api(#[from] lucid_vmm::api::ApiError),
    #[error(transparent)]
    Top(#[from] top::TopError),
    #[error(
        "--api-socket with neither --kernel nor --guest serves the REST API, where the VM comes \
         from vm.create: {0} belongs in its body (docs/api.md)"
    )]
    RestFlag(&'static str),
    #[error(transparent)]
    DeviceServer(#[from] lucid_vhost_net::ServerError),
    #[error(transparent)]
    VfioServer(#[from] lucid_vfio_server::ServerError),
}

impl CliError {
    /// A command line Lucid refuses, rather than a failure while doing what it asked.
    fn is_usage(&self) -> bool {
        matches!(
            self,
            CliError::NoGuest(_)
                | CliError::Device(_)
                | CliError::Config(_)
                | CliError::ConfigRead { .. }
                | CliError::ConfigJson { .. }
                | CliError::ConfigCh { .. }
                | CliError::Vmm(lucid_vmm::VmmError::Config(_))
                | CliError::RestFlag(_)
        ) || matches!(self, CliError::DeviceServer(e) if e.is_usage())
            || matches!(self, CliError::VfioServer(e) if e.is_usage())
    }
}

/// The VM the flags describe.
fn flags_config(args: &RunArgs) -> Result<VmConfig, CliError> {
    let kernel = match (&args.kernel, &args.guest) {
        (Some(k), _) => KernelSource::File(k.clone()),
        (None, g) => {
            let name = g.as_deref().unwrap_or("hostinfo");
            let bytes = lucid_guests::get(name).ok_or_else(|| CliError::NoGuest(name.into()))?;
            KernelSource::Builtin {
                name: name.into(),
                bytes,
            }
        }
    };
    let mut config = VmConfig::new(kernel);
    config.payload.initrd = args.initrd.clone();
    config.payload.cmdline = args.cmdline.clone();
    config.machine.mem_mib = args.memory;
    config.machine.vcpus = args.vcpus;
    config.devices.serial = lucid_vmm::parse_serial(&args.serial)?;
    // SAFETY: isatty on fd 0 has no preconditions.
    config.devices.serial_stdin = unsafe { libc::isatty(0) } == 1;
    config.machine.backing = lucid_vmm::parse_backing(&args.backing)?;
    config.machine.seccomp = !args.no_seccomp;
    config.memory.limit_mib = args.memory_limit;
    config.memory.swap_mode = args.swap_mode;
    config.memory.pager = args.swap_pager == "on";
    config.symbiotic.enabled = args.symbiotic;
    config.api.socket = args.api_socket.clone();
    config.jail = args
        .jail
        .as_deref()
        .map(lucid_vmm::parse_jail)
        .transpose()?;
    for b in &args.blk {
        config.devices.pci.push(lucid_vmm::parse_blk(b)?);
    }
    for (i, n) in args.net.iter().enumerate() {
        config.devices.pci.push(lucid_vmm::parse_net(n, i)?);
    }
    config.iommu = args
        .iommu
        .as_deref()
        .map(lucid_vmm::parse_iommu)
        .transpose()?;
    for d in &args.device {
        config
            .devices
            .platform_pci
            .push(lucid_vmm::parse_device(d)?);
    }
    config.pools.pool = lucid_vmm::parse_pool(&args.pool)?;
    config.pools.low_noise = args.low_noise;
    config.devices.hotplug = args.hotplug;
    config.pools.monitor.window = std::time::Duration::from_millis(args.monitor_window_ms);
    config.pools.monitor.classifier.agree = args.classify_windows;
    config.pools.monitor.classifier.dwell =
        std::time::Duration::from_millis(args.classify_dwell_ms);
    config.devices.balloon = args
        .balloon
        .as_deref()
        .map(lucid_vmm::parse_balloon)
        .transpose()?;
    config.devices.rng = args.rng.as_deref().map(lucid_vmm::parse_rng).transpose()?;
    config.devices.fw_cfg = args.fw_cfg.as_deref() != Some("off");
    config.devices.console = match args.console_virtio.as_deref() {
        Some(s) => lucid_vmm::parse_console_virtio(s)?,
        None => None,
    };
    for f in &args.fs {
        config.devices.pci.push(lucid_vmm::parse_fs(f)?);
    }
    for v in &args.vsock {
        config.devices.pci.push(lucid_vmm::parse_vsock(v)?);
    }
    for u in &args.user_device {
        config
            .devices
            .user_devices
            .push(lucid_vmm::parse_user_device(u)?);
    }
    Ok(config)
}

fn run(mut args: RunArgs) -> Result<ExitCode, CliError> {
    if let Some(socket) = &mut args.api_socket {
        *socket = top::api_socket_path(socket)?;
    }
    if let (None, None, None, Some(socket)) =
        (&args.config, &args.kernel, &args.guest, &args.api_socket)
    {
        if let Some(flag) = vm_flag_given(&args) {
            return Err(CliError::RestFlag(flag));
        }
        return Ok(exit(rest::RestServer::bind(socket)?.serve().code));
    }
    let builtin_default = args.config.is_none() && args.kernel.is_none() && args.guest.is_none();
    let mut config = match &args.config {
        Some(path) => config_file(path)?,
        None => flags_config(&args)?,
    };
    // The lucid command always stops its VM on SIGINT/SIGTERM, whichever way it was described.
    config.machine.handle_signals = true;
    config.runtime.builtin_modules = Some(lucid_guests::module);
    config.runtime.oom_guard = Some(oom_guard_command);
    config.validate()?;
    if args.print_config {
        println!(
            "{}",
            serde_json::to_string_pretty(&config).expect("JSON of plain values")
        );
        return Ok(ExitCode::SUCCESS);
    }

    // The REST API beside the VM, bound before the VM's threads start: they inherit the signal
    // mask through which the server, not the VM, takes SIGINT and SIGTERM, and a socket in use
    // fails the run before the guest runs.
    let server = match config.api.socket.take() {
        Some(path) => {
            config.machine.handle_signals = false;
            Some(rest::RestServer::bind(&path)?)
        }
        None => None,
    };
    // Checked before the run, not after it: a typo in the path should not cost a whole run.
    let stats_file = create_stats_file("--stats-json", &args.stats_json)?;
    let prom_file = create_stats_file("--stats-prom", &args.stats_prom)?;
    let built = Vm::build(config.clone());
    if built.is_err() {
        for path in [&args.stats_json, &args.stats_prom].into_iter().flatten() {
            let _ = std::fs::remove_file(path);
        }
    }
    let mut vm = built?;
    if builtin_default {
        log::info!(
            "no --kernel given: running the built-in probe guest `hostinfo` on this host (KVM backend: {})",
            vm.backend()
        );
    }
    vm.start()?;
    let (report, code) = match server {
        Some(mut server) => {
            server.adopt(vm, config);
            let served = server.serve();
            match served.report {
                Some(report) => (report, served.code),
                None => return Ok(exit(served.code)),
            }
        }
        None => {
            vm.confine_caller()?;
            let report = vm.wait();
            // The built-in host report succeeds with exit status 0 when the guest reports
            // success (0); every other run follows QEMU's debug-exit convention.
            let code = match report.stop {
                StopReason::DebugExit(0) if builtin_default => 0,
                _ => report.exit_code(),
            };
            (report, code)
        }
    };
    for line in report.summary().lines() {
        log::info!("{line}");
    }
    if let (Some(file), Some(path)) = (stats_file, &args.stats_json) {
        let text = serde_json::to_string_pretty(&report.to_json()).expect("JSON of plain values");
        write_stats("--stats-json", file, path, text + "\n")?;
    }
    if let (Some(file), Some(path)) = (prom_file, &args.stats_prom) {
        let text = lucid_stats::prometheus_text(&report.counters);
        write_stats("--stats-prom", file, path, text)?;
    }
    if let StopReason::Error(e) = &report.stop {
        log::error!("{}", lucid_vmm::error_chain(e.as_ref()));
    }
    Ok(exit(code))
}

/// `--config FILE`: the VM as JSON, a built-in guest's image filled in by its name.
fn config_file(path: &std::path::Path) -> Result<VmConfig, CliError> {
    let text = std::fs::read_to_string(path).map_err(|source| CliError::ConfigRead {
        path: path.into(),
        source,
    })?;
    let json_error = |source| CliError::ConfigJson {
        path: path.into(),
        source,
    };
    let value: serde_json::Value = serde_json::from_str(&text).map_err(json_error)?;
    // Cloud Hypervisor's VmConfig (the body of `vm.create`) names the kernel by a string;
    // Lucid's own by an object (`{"file": ...}`, `{"builtin": ...}`).
    if value["payload"]["kernel"].is_string() {
        return rest::config::map(value).map_err(|source| CliError::ConfigCh {
            path: path.into(),
            source,
        });
    }
    let mut config: VmConfig = serde_json::from_value(value).map_err(json_error)?;
    if let KernelSource::Builtin { name, bytes } = &mut config.payload.kernel {
        *bytes = lucid_guests::get(name).ok_or_else(|| CliError::NoGuest(name.clone()))?;
    }
    Ok(config)
}

/// A `--stats-*` file, created before the run.
fn create_stats_file(
    flag: &'static str,
    path: &Option<PathBuf>,
) -> Result<Option<std::fs::File>, CliError> {
    let Some(path) = path else { return Ok(None) };
    std::fs::File::create(path)
        .map(Some)
        .map_err(|source| CliError::StatsFile {
            flag,
            path: path.clone(),
            source,
        })
}

fn write_stats(
    flag: &'static str,
    mut file: std::fs::File,
    path: &std::path::Path,
    text: String,
) -> Result<(), CliError> {
    std::io::Write::write_all(&mut file, text.as_bytes()).map_err(|source| CliError::StatsFile {
        flag,
        path: path.into(),
        source,
    })
}

/// The first flag that describes a VM, which the REST API takes from `vm.create` instead.
fn vm_flag_given(a: &RunArgs) -> Option<&'static str> {
    [
        (a.initrd.is_some(), "--initrd"),
        (!a.cmdline.is_empty(), "--cmdline"),
        (a.memory != 256, "--memory"),
        (a.vcpus != 1, "--vcpus"),
        (a.serial != "stdio", "--serial"),
        (a.backing != "anon", "--backing"),
        (a.stats_json.is_some(), "--stats-json"),
        (a.stats_prom.is_some(), "--stats-prom"),
        (a.print_config, "--print-config"),
        (!a.blk.is_empty(), "--blk"),
        (!a.net.is_empty(), "--net"),
        (a.iommu.is_some(), "--iommu"),
        (a.balloon.is_some(), "--balloon"),
        (a.rng.is_some(), "--rng"),
        (!a.fs.is_empty(), "--fs"),
        (!a.vsock.is_empty(), "--vsock"),
        (!a.user_device.is_empty(), "--user-device"),
        (!a.device.is_empty(), "--device"),
        (a.hotplug, "--hotplug"),
        (a.fw_cfg.is_some(), "--fw-cfg"),
        (a.console_virtio.is_some(), "--console-virtio"),
        (a.memory_limit.is_some(), "--memory-limit"),
        (a.symbiotic, "--symbiotic"),
        (a.pool != "auto", "--pool"),
        (a.low_noise, "--low-noise"),
        (a.no_seccomp, "--no-seccomp"),
        (a.jail.is_some(), "--jail"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
}

/// This very binary serving as the VM's OOM guard (`lucid_swap::guard`).
fn oom_guard_command() -> std::process::Command {
    let mut c = std::process::Command::new("/proc/self/exe");
    c.arg(lucid_vmm::lucid_swap::guard::ARGV1);
    c
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(lucid_vmm::lucid_swap::guard::ARGV1) {
        logger::install(log::LevelFilter::Info, log::LevelFilter::Info, false);
        return ExitCode::from(lucid_vmm::lucid_swap::guard::serve(&argv[2..]) as u8);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors: clap prints them to stdout.
            let _ = e.print();
            return match e.use_stderr() {
                true => exit(EXIT_USAGE),
                false => ExitCode::SUCCESS,
            };
        }
    };
    let level = logger::level(cli.log_level, cli.quiet, cli.verbose);
    // A benchmark builds dozens of VMs: their per-VM decisions (info) are noise there unless
    // asked for, and each warning (a rung that fell back) is said once.
    let bench = matches!(cli.cmd, Cmd::Bench { .. });
    let vmm_level = match bench && cli.log_level.is_none() && cli.verbose == 0 {
        true => level.min(log::LevelFilter::Warn),
        false => level,
    };
    logger::install(level, vmm_level, bench);
    let result = match cli.cmd {
        Cmd::Run(args) => run(*args),
        Cmd::Probe { json, quick } => lucid_probe::run_probe(&lucid_probe::ProbeOptions { quick })
            .map(|r| {
                if json {
                    println!("{}", r.to_json());
                } else {
                    print!("{r}");
                }
                ExitCode::SUCCESS
            })
            .map_err(CliError::from),
        Cmd::Bench { what } => lucid_bench::run(what).map_err(CliError::Bench),
        Cmd::Pools { what } => pools_cmd::run(what).map_err(CliError::PoolsCmd),
        Cmd::Sym(args) => sym_cmd::run(args).map_err(CliError::Sym),
        Cmd::Top(args) => top::run(args).map_err(CliError::from),
        Cmd::Guests { write: None } => {
            for n in lucid_guests::NAMES {
                println!("{n}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Guests { write: Some(dir) } => lucid_guests::write_all(&dir)
            .map(|paths| {
                for p in paths {
                    println!("{}", p.display());
                }
                ExitCode::SUCCESS
            })
            .map_err(|source| CliError::GuestsWrite { dir, source }),
        Cmd::DeviceServer {
            what: DeviceServerKind::VhostUser(what),
        } => lucid_vhost_net::run(what)
            .map(|summary| {
                println!("{summary}");
                summary.exit_code()
            })
            .map_err(CliError::from),
        Cmd::DeviceServer {
            what: DeviceServerKind::VfioUser(what),
        } => lucid_vfio_server::run(what)
            .map(|summary| {
                println!("{summary}");
                summary.exit_code()
            })
            .map_err(CliError::from),
    };
    result.unwrap_or_else(|e| {
        let msg = lucid_vmm::error_chain(&e);
        if e.is_usage() {
            // In clap's format, as clap's own refusals are.
            let mut cmd = Cli::command();
            let _ = cmd
                .error(clap::error::ErrorKind::ValueValidation, msg)
                .print();
            return exit(EXIT_USAGE);
        }
        // Printed whatever the log level: it is the reason for the failure status.
        eprintln!("lucid: {msg}");
        exit(EXIT_FAILURE)
    })
}

/// The process exit status `code` (every status Lucid uses fits in a byte).
fn exit(code: i32) -> ExitCode {
    ExitCode::from(code as u8)
}
