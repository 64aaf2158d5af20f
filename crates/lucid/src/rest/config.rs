//! Cloud Hypervisor's `VmConfig` (the body of `vm.create`) mapped onto Lucid's [`VmConfig`]
//! (docs/api.md lists every field). Nothing is ignored: a field Lucid supports is mapped, a
//! Cloud Hypervisor field Lucid lacks is accepted only at its default (or `null`), and any
//! other field is refused, each refusal naming the field.

use std::path::PathBuf;

use lucid_vmm::{ConsoleConfig, ConsoleOutput};
use lucid_vmm::{
    KernelSource, PciDeviceConfig, RateLimiterConfig, SerialOutput, SwapMode, VmConfig,
};
use serde_json::{json, Map, Value};

/// Why a `vm.create` body was refused: one message that names the field.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

fn refuse<T>(msg: String) -> Result<T, Refusal> {
    Err(Refusal(msg))
}

/// One JSON object being taken apart; what is left at [`Obj::finish`] is checked.
struct Obj {
    at: String,
    map: Map<String, Value>,
}

impl Obj {
    fn new(at: String, v: Value) -> Result<Obj, Refusal> {
        match v {
            Value::Object(map) => Ok(Obj { at, map }),
            _ => refuse(format!("{}: expected a JSON object", at_or_top(&at))),
        }
    }

    fn field(&self, k: &str) -> String {
        match self.at.is_empty() {
            true => k.to_string(),
            false => format!("{}.{k}", self.at),
        }
    }

    /// The value of `k`; `null` counts as absent.
    fn take(&mut self, k: &str) -> Option<Value> {
        self.map.remove(k).filter(|v| !v.is_null())
    }

    fn u64(&mut self, k: &str) -> Result<Option<u64>, Refusal> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n)),
                None => refuse(format!(
                    "{}: expected an unsigned integer, got {v}",
                    self.field(k)
                )),
            },
        }
    }

    fn bool(&mut self, k: &str) -> Result<Option<bool>, Refusal> {
        match self.take(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => refuse(format!(
                "{}: expected true or false, got {v}",
                self.field(k)
            )),
        }
    }

    fn str(&mut self, k: &str) -> Result<Option<String>, Refusal> {
        match self.take(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => refuse(format!("{}: expected a string, got {v}", self.field(k))),
        }
    }

    fn obj(&mut self, k: &str) -> Result<Option<Obj>, Refusal> {
        let at = self.field(k);
        self.take(k).map(|v| Obj::new(at, v)).transpose()
    }

    /// The elements of the array `k`, each an object.
    fn objs(&mut self, k: &str) -> Result<Vec<Obj>, Refusal> {
        let at = self.field(k);
        match self.take(k) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .into_iter()
                .enumerate()
                .map(|(i, v)| Obj::new(format!("{at}[{i}]"), v))
                .collect(),
            Some(v) => refuse(format!("{at}: expected an array, got {v}")),
        }
    }

    /// The strings of the array `k`.
    fn strs(&mut self, k: &str) -> Result<Vec<String>, Refusal> {
        let at = self.field(k);
        match self.take(k) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s),
                    v => refuse(format!("{at}[{i}]: expected a string, got {v}")),
                })
                .collect(),
            Some(v) => refuse(format!("{at}: expected an array of strings, got {v}")),
        }
    }

    /// Refuses what is left: a field of `lacks` (Cloud Hypervisor's, which Lucid does not
    /// support) unless it holds its default, and every other field.
    fn finish(self, lacks: &[(&str, Value)]) -> Result<(), Refusal> {
        for (k, v) in &self.map {
            let field = self.field(k);
            match lacks.iter().find(|(name, _)| name == k) {
                Some(_) if is_empty(v) => {}
                Some((_, default)) if v == default => {}
                Some((_, default)) => {
                    return refuse(format!(
                        "{field}: Lucid does not support this field; only its default ({}) is \
                         accepted, got {v}",
                        match default {
                            Value::Null => "absent or null".to_string(),
                            d => d.to_string(),
                        }
                    ))
                }
                None => {
                    return refuse(format!(
                        "{field}: unknown field (docs/api.md lists the fields Lucid knows)"
                    ))
                }
            }
        }
        Ok(())
    }
}

fn at_or_top(at: &str) -> &str {
    match at.is_empty() {
        true => "the body",
        false => at,
    }
}

/// `null`, `false`, an empty array or object: the default of every optional feature.
fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// The prefix of a built-in probe guest as `payload.kernel` (`builtin:spin`).
pub const BUILTIN_PREFIX: &str = "builtin:";

/// Maps a `vm.create` body onto a validated [`VmConfig`].
pub fn map(body: Value) -> Result<VmConfig, Refusal> {
    let mut top = Obj::new(String::new(), body)?;

    let mut payload = top
        .obj("payload")?
        .ok_or_else(|| Refusal("payload: required (payload.kernel names the kernel)".into()))?;
    let kernel = payload
        .str("kernel")?
        .ok_or_else(|| Refusal("payload.kernel: required (a path, or builtin:NAME)".into()))?;
    let kernel = match kernel.strip_prefix(BUILTIN_PREFIX) {
        Some(name) => KernelSource::Builtin {
            name: name.into(),
            bytes: lucid_guests::get(name).ok_or_else(|| {
                Refusal(format!(
                    "payload.kernel: no built-in guest {name:?}; built-in guests: {}",
                    lucid_guests::NAMES.join(", ")
                ))
            })?,
        },
        None => KernelSource::File(kernel.into()),
    };
    let mut config = VmConfig::new(kernel);
    config.payload.cmdline = payload.str("cmdline")?.unwrap_or_default();
    config.payload.initrd = payload.str("initramfs")?.map(PathBuf::from);
    payload.finish(&[
        ("firmware", Value::Null),
        ("igvm", Value::Null),
        ("host_data", Value::Null),
    ])?;

    if let Some(mut cpus) = top.obj("cpus")? {
        let boot = cpus.u64("boot_vcpus")?.unwrap_or(1);
        let max = u64::from(lucid_vmm::MAX_VCPUS);
        config.machine.vcpus = u8::try_from(boot)
            .ok()
            .filter(|&n| (1..=max).contains(&u64::from(n)))
            .ok_or_else(|| {
                Refusal(format!(
                    "cpus.boot_vcpus: {boot} vCPUs; Lucid runs 1 to {max}"
                ))
            })?;
        if let Some(max) = cpus.u64("max_vcpus")? {
            if max != boot {
                return refuse(format!(
                    "cpus.max_vcpus: Lucid has no vCPU hotplug, so max_vcpus must equal \
                     boot_vcpus ({boot}), got {max}"
                ));
            }
        }
        if let Some(mut topology) = cpus.obj("topology")? {
            // lucid-boot's CPUID presents the vCPUs as the cores of one package, one thread
            // each: that topology is accepted, any other refused.
            let flat = [
                ("threads_per_core", 1),
                ("cores_per_die", boot),
                ("dies_per_package", 1),
                ("packages", 1),
            ];
            for (k, want) in flat {
                match topology.u64(k)? {
                    Some(got) if got != want => {
                        return refuse(format!(
                            "{}: Lucid's vCPUs are the cores of one die in one package, one \
                             thread each, so only {want} is accepted here, got {got}",
                            topology.field(k)
                        ))
                    }
                    _ => {}
                }
            }
            topology.finish(&[])?;
        }
        cpus.finish(&[
            ("kvm_hyperv", json!(false)),
            ("max_phys_bits", json!(46)),
            ("affinity", Value::Null),
            ("features", Value::Null),
            ("nested", json!(true)),
        ])?;
    }

    if let Some(mut memory) = top.obj("memory")? {
        if let Some(size) = memory.u64("size")? {
            if size % (1 << 20) != 0 {
                return refuse(format!(
                    "memory.size: Lucid sizes guest RAM in whole MiB, got {size} bytes"
                ));
            }
            let (min, max) = (lucid_vmm::MIN_MEM_MIB, lucid_vmm::MAX_MEM_MIB);
            if !(min..=max).contains(&(size >> 20)) {
                return refuse(format!(
                    "memory.size: {} MiB; Lucid takes {min} to {max} MiB",
                    size >> 20
                ));
            }
            if let Some(host) = host_ram_mib().filter(|&h| size >> 20 > h) {
                return refuse(format!(
                    "memory.size: {} MiB is more than this host's RAM ({host} MiB)",
                    size >> 20
                ));
            }
            config.machine.mem_mib = size >> 20;
        }
        if memory.bool("shared")? == Some(true) {
            config.machine.backing = lucid_vmm::Backing::SharedMemfd;
        }
        memory.finish(&[
            ("mergeable", json!(false)),
            ("hotplug_method", json!("Acpi")),
            ("hotplug_size", Value::Null),
            ("hotplugged_size", Value::Null),
            ("hugepages", json!(false)),
            ("hugepage_size", Value::Null),
            ("prefault", json!(false)),
            ("thp", json!(true)),
            ("zones", Value::Null),
        ])?;
    } else {
        // Cloud Hypervisor's default guest RAM.
        config.machine.mem_mib = 512;
    }

    let iommu = top.bool("iommu")?.unwrap_or(false);
    if iommu {
        config.iommu = Some(lucid_vmm::parse_iommu("vtd").map_err(opt_refusal("iommu"))?);
    }
    for d in top.objs("disks")? {
        config.devices.pci.push(disk(d, iommu)?);
    }
    let mut nets = 0;
    for n in top.objs("net")? {
        config.devices.pci.push(net(n, iommu, nets)?);
        nets += 1;
    }
    for f in top.objs("fs")? {
        config.devices.pci.push(fs(f, iommu)?);
    }

    // Cloud Hypervisor's serial defaults to Null: output dropped.
    config.devices.serial = SerialOutput::File("/dev/null".into());
    if let Some(mut serial) = top.obj("serial")? {
        let mode = serial.str("mode")?.unwrap_or_else(|| "Null".into());
        let file = serial.str("file")?;
        let socket = serial.str("socket")?;
        config.devices.serial = match (mode.as_str(), file, socket) {
            ("Null" | "Off", None, None) => SerialOutput::File("/dev/null".into()),
            ("Tty", None, None) => SerialOutput::Stdio,
            ("File", Some(f), None) => SerialOutput::File(f.into()),
            ("Socket", None, Some(s)) => SerialOutput::Unix(s.into()),
            (m, _, _) => {
                return refuse(format!(
                    "serial: mode {m:?} with these fields is not supported: Lucid takes Null, \
                     Off, Tty, File (with file) or Socket (with socket)"
                ))
            }
        };
        serial.finish(&[("iommu", json!(false))])?;
    }
    // Cloud Hypervisor's virtio-console; absent, the VM has none (Lucid's console is the
    // serial port).
    if let Some(mut console) = top.obj("console")? {
        let mode = console.str("mode")?.unwrap_or_else(|| "Tty".into());
        let file = console.str("file")?;
        let socket = console.str("socket")?;
        config.devices.console = match (mode.as_str(), file, socket) {
            ("Off" | "Null", None, None) => None,
            ("Tty", None, None) => Some(ConsoleOutput::Tty),
            ("File", Some(f), None) => Some(ConsoleOutput::File(f.into())),
            ("Socket", None, Some(s)) => Some(ConsoleOutput::Socket(s.into())),
            (m, _, _) => {
                return refuse(format!(
                    "console: mode {m:?} with these fields is not supported: Lucid takes Off, \
                     Null, Tty, File (with file) or Socket (with socket)"
                ))
            }
        }
        .map(|output| ConsoleConfig {
            output,
            ports: Vec::new(),
        });
        console.finish(&[("iommu", json!(false))])?;
    }

    if let Some(mut b) = top.obj("balloon")? {
        let size = b.u64("size")?.unwrap_or(0);
        if size % (1 << 20) != 0 {
            return refuse(format!(
                "balloon.size: Lucid sizes the balloon in whole MiB, got {size} bytes"
            ));
        }
        let opts = format!(
            "size={},deflate_on_oom={},free_page_reporting={}",
            size >> 20,
            on(b.bool("deflate_on_oom")?.unwrap_or(false)),
            on(b.bool("free_page_reporting")?.unwrap_or(false)),
        );
        b.finish(&[])?;
        config.devices.balloon =
            Some(lucid_vmm::parse_balloon(&opts).map_err(opt_refusal("balloon"))?);
    }

    if let Some(mut r) = top.obj("rng")? {
        // Lucid's device reads getrandom(2): the kernel's pool behind both of these files.
        match r.str("src")?.as_deref() {
            None | Some("/dev/urandom" | "/dev/random") => {}
            Some(src) => {
                return refuse(format!(
                    "{}: Lucid's virtio-rng reads the host's getrandom, so only /dev/urandom \
                     or /dev/random is accepted, got {src:?}",
                    r.field("src")
                ))
            }
        }
        device_iommu(&mut r, iommu)?;
        r.finish(&[])?;
        config.devices.rng = Some(lucid_vmm::parse_rng("").map_err(opt_refusal("rng"))?);
    }

    if let Some(platform) = top.obj("platform")? {
        // One PCI segment, no confidential guest, no SMBIOS strings.
        platform.finish(&[
            ("num_pci_segments", json!(1)),
            ("iommu_segments", Value::Null),
            ("iommu_address_width", Value::Null),
            ("iommu_address_width_bits", Value::Null),
            ("system_serial_number", Value::Null),
            ("serial_number", Value::Null),
            ("system_uuid", Value::Null),
            ("uuid", Value::Null),
            ("oem_strings", Value::Null),
            ("system_manufacturer", Value::Null),
            ("system_product_name", Value::Null),
            ("system_version", Value::Null),
            ("system_family", Value::Null),
            ("system_sku_number", Value::Null),
            ("chassis_asset_tag", Value::Null),
            ("tdx", json!(false)),
            ("sev_snp", json!(false)),
            ("iommufd", json!(false)),
            ("vfio_p2p_dma", json!(true)),
        ])?;
    }

    if let Some(v) = top.obj("vsock")? {
        config.devices.pci.push(vsock(v, iommu)?);
    }

    for u in top.objs("user_devices")? {
        config.devices.user_devices.push(user_device(u, iommu)?);
    }

    if let Some(ext) = top.obj("lucid")? {
        extension(ext, &mut config, nets)?;
    }

    top.finish(&[
        ("pmem", Value::Null),
        ("devices", Value::Null),
        ("vdpa", Value::Null),
        ("sgx_epc", Value::Null),
        ("numa", Value::Null),
        ("watchdog", json!(false)),
        ("pvpanic", json!(false)),
        ("tpm", Value::Null),
        ("landlock_enable", json!(false)),
        ("landlock_rules", Value::Null),
        ("rate_limit_groups", Value::Null),
        ("debug_console", Value::Null),
        ("pci_segments", Value::Null),
        ("preserved_fds", Value::Null),
    ])?;

    config
        .validate()
        .map_err(|e| Refusal(lucid_vmm::error_chain(&e)))?;
    Ok(config)
}

/// A device's `iommu` must equal the VM's: Lucid puts every device behind the vIOMMU or none.
fn device_iommu(d: &mut Obj, iommu: bool) -> Result<(), Refusal> {
    let want = d.bool("iommu")?.unwrap_or(false);
    match want == iommu {
        true => Ok(()),
        false => refuse(format!(
            "{}: Lucid puts every device behind the vIOMMU when the top-level `iommu` is \
             true and none otherwise, so this must equal it ({iommu})",
            d.field("iommu")
        )),
    }
}

/// One `DiskConfig` (of `disks`, or the body of `vm.add-disk`), named by its `id`.
fn disk(mut d: Obj, iommu: bool) -> Result<PciDeviceConfig, Refusal> {
    if d.bool("vhost_user")? == Some(true) {
        return vhost_user_disk(d, iommu);
    }
    let path = d
        .str("path")?
        .ok_or_else(|| Refusal(format!("{}: required", d.field("path"))))?;
    if path.contains(',') {
        return refuse(format!(
            "{}: Lucid cannot take a path with a comma",
            d.field("path")
        ));
    }
    if std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
        return refuse(format!(
            "{}: {path} is a directory; a disk is an image file or a block device",
            d.field("path")
        ));
    }
    let ro = d.bool("readonly")?.unwrap_or(false);
    let direct = d.bool("direct")?.unwrap_or(false);
    let mut opts = format!(
        "path={path},ro={},cache={}",
        on(ro),
        if direct { "none" } else { "writeback" }
    );
    if let Some(serial) = d.str("serial")? {
        opts += &format!(",id={serial}");
    }
    match d.str("image_type")?.as_deref() {
        None | Some("Raw") => {}
        Some(t) => {
            return refuse(format!(
                "{}: Lucid reads every disk image as raw, so only Raw is accepted, got {t:?}",
                d.field("image_type")
            ))
        }
    }
    device_iommu(&mut d, iommu)?;
    let id = d.str("id")?;
    let at = d.at.clone();
    let limits = rate_limiter(&mut d)?;
    d.finish(&[
        ("num_queues", json!(1)),
        ("queue_size", json!(128)),
        ("vhost_user", json!(false)),
        ("vhost_socket", Value::Null),
        ("rate_limit_group", Value::Null),
        ("pci_segment", json!(0)),
        ("queue_affinity", Value::Null),
        ("backing_files", json!(false)),
        ("sparse", json!(true)),
        ("disable_io_uring", json!(false)),
        ("disable_aio", json!(false)),
    ])?;
    let mut blk = lucid_vmm::parse_blk(&opts).map_err(opt_refusal(&at))?;
    blk.name = id;
    blk.rate_limiter = limits;
    Ok(blk)
}

/// `socket` (a JSON string at `field`) as a sub-option value: no comma.
fn socket_opt(d: &mut Obj, key: &str) -> Result<String, Refusal> {
    let socket = d
        .str(key)?
        .ok_or_else(|| Refusal(format!("{}: required", d.field(key))))?;
    if socket.contains(',') {
        return refuse(format!(
            "{}: Lucid cannot take a path with a comma",
            d.field(key)
        ));
    }
    Ok(socket)
}

/// `num_queues` and `queue_size` of a vhost-user device, as sub-options.
fn queue_opts(d: &mut Obj) -> Result<String, Refusal> {
    let mut opts = String::new();
    if let Some(n) = d.u64("num_queues")? {
        opts += &format!(",num_queues={n}");
    }
    if let Some(n) = d.u64("queue_size")? {
        opts += &format!(",queue_size={n}");
    }
    Ok(opts)
}

/// A `DiskConfig` with `vhost_user: true`: the disk is `vhost_socket`'s back-end's.
fn vhost_user_disk(mut d: Obj, iommu: bool) -> Result<PciDeviceConfig, Refusal> {
    if d.str("path")?.is_some() {
        return refuse(format!(
            "{}: a vhost-user disk's image is its back-end's: give vhost_socket only",
            d.field("path")
        ));
    }
    let socket = socket_opt(&mut d, "vhost_socket")?;
    let opts = format!("vhost_user=on,socket={socket}{}", queue_opts(&mut d)?);
    device_iommu(&mut d, iommu)?;
    let id = d.str("id")?;
    let at = d.at.clone();
    d.finish(&[
        ("readonly", json!(false)),
        ("direct", json!(false)),
        ("image_type", Value::Null),
        ("serial", Value::Null),
        ("rate_limiter_config", Value::Null),
        ("rate_limit_group", Value::Null),
        ("pci_segment", json!(0)),
        ("queue_affinity", Value::Null),
        ("backing_files", json!(false)),
        ("sparse", json!(true)),
        ("disable_io_uring", json!(false)),
        ("disable_aio", json!(false)),
    ])?;
    let mut blk = lucid_vmm::parse_blk(&opts).map_err(opt_refusal(&at))?;
    blk.name = id;
    Ok(blk)
}

/// One `FsConfig` (of `fs`, or the body of `vm.add-fs`): virtio-fs on `socket`'s back-end.
fn fs(mut f: Obj, iommu: bool) -> Result<PciDeviceConfig, Refusal> {
    let tag = f
        .str("tag")?
        .ok_or_else(|| Refusal(format!("{}: required", f.field("tag"))))?;
    if tag.contains(',') {
        return refuse(format!(
            "{}: Lucid cannot take a tag with a comma",
            f.field("tag")
        ));
    }
    let socket = socket_opt(&mut f, "socket")?;
    let mut opts = format!("tag={tag},socket={socket}{}", queue_opts(&mut f)?);
    if let Some(id) = f.str("id")? {
        opts += &format!(",id={id}");
    }
    device_iommu(&mut f, iommu)?;
    let at = f.at.clone();
    f.finish(&[("pci_segment", json!(0))])?;
    lucid_vmm::parse_fs(&opts).map_err(opt_refusal(&at))
}

/// One `NetConfig` (of `net`, or the body of `vm.add-net`), the VM's `index`th NIC, named by
/// its `id`.
fn net(mut n: Obj, iommu: bool, index: usize) -> Result<PciDeviceConfig, Refusal> {
    if n.bool("vhost_user")? == Some(true) {
        // Lucid dials the back-end's socket: Cloud Hypervisor's "Client" mode.
        match n.str("vhost_mode")?.as_deref() {
            None | Some("Client") => {}
            Some(m) => {
                return refuse(format!(
                    "{}: Lucid connects to the back-end (Client), got {m:?}",
                    n.field("vhost_mode")
                ))
            }
        }
        let socket = socket_opt(&mut n, "vhost_socket")?;
        let mut opts = format!("vhost_user=on,socket={socket}{}", queue_opts(&mut n)?);
        if let Some(mac) = n.str("mac")? {
            opts += &format!(",mac={mac}");
        }
        device_iommu(&mut n, iommu)?;
        let id = n.str("id")?;
        let at = n.at.clone();
        n.finish(&[
            ("ip", json!("192.168.249.1")),
            ("mask", json!("255.255.255.0")),
            ("host_mac", Value::Null),
            ("mtu", Value::Null),
            ("tap", Value::Null),
            ("fds", Value::Null),
            ("rate_limiter_config", Value::Null),
            ("pci_segment", json!(0)),
            ("offload_tso", json!(true)),
            ("offload_ufo", json!(true)),
            ("offload_csum", json!(true)),
        ])?;
        let mut nic = lucid_vmm::parse_net(&opts, index).map_err(opt_refusal(&at))?;
        nic.name = id;
        return Ok(nic);
    }
    let tap = n.str("tap")?.ok_or_else(|| {
        Refusal(format!(
            "{}: Lucid's net back-ends are a tap interface (tap) or, in the extension, \
             lucid.net (echo, sink): give tap",
            n.field("tap")
        ))
    })?;
    let mut opts = format!("backend=tap:{tap}");
    if let Some(mac) = n.str("mac")? {
        opts += &format!(",mac={mac}");
    }
    device_iommu(&mut n, iommu)?;
    let id = n.str("id")?;
    let at = n.at.clone();
    let limits = rate_limiter(&mut n)?;
    n.finish(&[
        ("ip", json!("192.168.249.1")),
        ("mask", json!("255.255.255.0")),
        ("host_mac", Value::Null),
        ("mtu", Value::Null),
        ("num_queues", json!(2)),
        ("queue_size", json!(256)),
        ("vhost_user", json!(false)),
        ("vhost_socket", Value::Null),
        ("vhost_mode", json!("Client")),
        ("fds", Value::Null),
        ("pci_segment", json!(0)),
        ("offload_tso", json!(true)),
        ("offload_ufo", json!(true)),
        ("offload_csum", json!(true)),
    ])?;
    let mut nic = lucid_vmm::parse_net(&opts, index).map_err(opt_refusal(&at))?;
    nic.name = id;
    nic.rate_limiter = limits;
    Ok(nic)
}

/// A device's `rate_limiter_config` (Cloud Hypervisor's `RateLimiterConfig`), checked.
fn rate_limiter(d: &mut Obj) -> Result<Option<RateLimiterConfig>, Refusal> {
    let at = d.field("rate_limiter_config");
    d.take("rate_limiter_config")
        .map(|v| rate_limiter_config(&at, v))
        .transpose()
}

/// `v` as a `RateLimiterConfig` (`at` names it in a refusal).
pub fn rate_limiter_config(at: &str, v: Value) -> Result<RateLimiterConfig, Refusal> {
    let cfg: RateLimiterConfig = serde_json::from_value(v).map_err(|e| {
        Refusal(format!(
            "{at}: {e} (bandwidth and ops, each {{size, one_time_burst, refill_time}})"
        ))
    })?;
    cfg.validate().map_err(|e| Refusal(format!("{at}: {e}")))?;
    Ok(cfg)
}

/// The `VsockConfig` (or the body of `vm.add-vsock`): a hybrid vsock on a Unix socket, named
/// by its `id`.
fn vsock(mut v: Obj, iommu: bool) -> Result<PciDeviceConfig, Refusal> {
    let cid = v
        .u64("cid")?
        .ok_or_else(|| Refusal(format!("{}: required", v.field("cid"))))?;
    let socket = socket_opt(&mut v, "socket")?;
    let mut opts = format!("cid={cid},socket={socket}");
    device_iommu(&mut v, iommu)?;
    if let Some(id) = v.str("id")? {
        opts += &format!(",id={id}");
    }
    let at = v.at.clone();
    v.finish(&[("pci_segment", json!(0))])?;
    lucid_vmm::parse_vsock(&opts).map_err(opt_refusal(&at))
}

/// One `UserDeviceConfig` (of `user_devices`, or the body of `vm.add-user-device`): a
/// vfio-user device whose server listens on `socket`, named by its `id`.
fn user_device(mut u: Obj, iommu: bool) -> Result<lucid_vmm::UserDeviceConfig, Refusal> {
    let socket = socket_opt(&mut u, "socket")?;
    let mut opts = format!("socket={socket}");
    if let Some(id) = u.str("id")? {
        opts += &format!(",id={id}");
    }
    device_iommu(&mut u, iommu)?;
    let at = u.at.clone();
    u.finish(&[("pci_segment", json!(0)), ("pci_device_id", Value::Null)])?;
    lucid_vmm::parse_user_device(&opts).map_err(opt_refusal(&at))
}

/// The body of `vm.add-user-device` for a VM whose devices are behind the vIOMMU or not.
pub fn hot_user_device(body: Value, iommu: bool) -> Result<lucid_vmm::UserDeviceConfig, Refusal> {
    user_device(Obj::new(String::new(), body)?, iommu)
}

/// The body of `vm.add-disk` (`what` = "disk") or `vm.add-net` ("net") for a VM whose
/// devices are behind the vIOMMU (`iommu`) or not, with `nics` NICs so far.
pub fn hot_device(
    what: &str,
    body: Value,
    iommu: bool,
    nics: usize,
) -> Result<PciDeviceConfig, Refusal> {
    let d = Obj::new(String::new(), body)?;
    match what {
        "disk" => disk(d, iommu),
        "fs" => fs(d, iommu),
        "vsock" => vsock(d, iommu),
        _ => net(d, iommu, nics),
    }
}

/// The `lucid` extension object: Lucid's own sections, in the values of Lucid's own flags.
fn extension(mut ext: Obj, config: &mut VmConfig, mut nets: usize) -> Result<(), Refusal> {
    for (i, b) in ext.strs("blk")?.iter().enumerate() {
        let at = format!("lucid.blk[{i}]");
        config
            .devices
            .pci
            .push(lucid_vmm::parse_blk(b).map_err(opt_refusal(&at))?);
    }
    for (i, n) in ext.strs("net")?.iter().enumerate() {
        let at = format!("lucid.net[{i}]");
        config
            .devices
            .pci
            .push(lucid_vmm::parse_net(n, nets).map_err(opt_refusal(&at))?);
        nets += 1;
    }
    if let Some(s) = ext.str("iommu")? {
        config.iommu = Some(lucid_vmm::parse_iommu(&s).map_err(opt_refusal("lucid.iommu"))?);
    }
    if let Some(s) = ext.str("balloon")? {
        if config.devices.balloon.is_some() {
            return refuse("lucid.balloon: the VM already has `balloon`: give one of them".into());
        }
        config.devices.balloon =
            Some(lucid_vmm::parse_balloon(&s).map_err(opt_refusal("lucid.balloon"))?);
    }
    if let Some(s) = ext.str("rng")? {
        if config.devices.rng.is_some() {
            return refuse("lucid.rng: the VM already has `rng`: give one of them".into());
        }
        config.devices.rng = Some(lucid_vmm::parse_rng(&s).map_err(opt_refusal("lucid.rng"))?);
    }
    for (i, d) in ext.strs("device")?.iter().enumerate() {
        let at = format!("lucid.device[{i}]");
        config
            .devices
            .platform_pci
            .push(lucid_vmm::parse_device(d).map_err(opt_refusal(&at))?);
    }
    if let Some(s) = ext.str("backing")? {
        config.machine.backing =
            lucid_vmm::parse_backing(&s).map_err(opt_refusal("lucid.backing"))?;
    }
    config.memory.limit_mib = ext.u64("memory_limit_mib")?;
    if let Some(m) = ext.take("swap_mode") {
        config.memory.swap_mode = serde_json::from_value::<SwapMode>(m).map_err(|e| {
            Refusal(format!(
                "lucid.swap_mode: {e} (baseline, mapper or vswapper)"
            ))
        })?;
    }
    if let Some(p) = ext.bool("swap_pager")? {
        config.memory.pager = p;
    }
    if let Some(p) = ext.str("pool")? {
        config.pools.pool = lucid_vmm::parse_pool(&p).map_err(opt_refusal("lucid.pool"))?;
    }
    if let Some(l) = ext.bool("low_noise")? {
        config.pools.low_noise = l;
    }
    if let Some(s) = ext.bool("symbiotic")? {
        config.symbiotic.enabled = s;
    }
    if let Some(s) = ext.bool("seccomp")? {
        config.machine.seccomp = s;
    }
    ext.finish(&[])
}

/// The host's RAM (`MemTotal`), when /proc/meminfo says.
fn host_ram_mib() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib >> 10)
}

fn on(b: bool) -> &'static str {
    match b {
        true => "on",
        false => "off",
    }
}

fn opt_refusal(at: &str) -> impl Fn(lucid_vmm::DeviceOptionError) -> Refusal + '_ {
    move |e| Refusal(format!("{at}: {}", lucid_vmm::error_chain(&e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(v: Value) -> String {
        map(v).expect_err("refused").0
    }

    #[test]
    fn maps_the_supported_fields() {
        let c = map(json!({
            "payload": {"kernel": "builtin:spin", "cmdline": "x"},
            "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
            "memory": {"size": 128u64 << 20, "shared": true, "thp": true},
            "disks": [{"path": "/tmp/d.img", "readonly": true, "num_queues": 1}],
            "serial": {"mode": "File", "file": "/tmp/s.out"},
            "console": {"mode": "Off"},
            "rng": null,
            "lucid": {"symbiotic": true, "net": ["backend=echo"]}
        }))
        .unwrap();
        assert_eq!(c.machine.vcpus, 2);
        assert_eq!(c.machine.mem_mib, 128);
        assert_eq!(c.machine.backing, lucid_vmm::Backing::SharedMemfd);
        assert_eq!(c.devices.pci.len(), 2);
        assert!(c.symbiotic.enabled);
        assert_eq!(c.payload.cmdline, "x");
    }

    #[test]
    fn refuses_unknown_and_unsupported_fields_by_name() {
        let base = |extra: (&str, Value)| {
            let mut v = json!({"payload": {"kernel": "builtin:spin"}});
            v[extra.0] = extra.1;
            refusal(v)
        };
        assert!(base(("bogus", json!(1))).contains("bogus: unknown field"));
        assert!(base(("rng", json!({"src": "/dev/hwrng"}))).starts_with("rng.src: "));
        assert!(base(("rng", json!({"src": "/dev/random", "iommu": true}))).contains("rng.iommu"));
        assert!(base(("rng", json!({"src": "/dev/urandom", "x": 1}))).contains("rng.x: unknown"));
        assert!(
            base(("memory", json!({"size": 1u64 << 30, "hugepages": true})))
                .contains("memory.hugepages")
        );
        assert!(base(("cpus", json!({"boot_vcpus": 1, "max_vcpus": 4}))).contains("max_vcpus"));
        assert!(base(("disks", json!([{"path": "/x", "queue_size": 64}])))
            .contains("disks[0].queue_size"));
        assert!(base(("console", json!({"mode": "Pty"}))).contains("console: mode \"Pty\""));
        assert!(base(("lucid", json!({"rung": "L2"}))).contains("lucid.rung: unknown"));
        assert!(refusal(json!({"payload": {"kernel": "builtin:nope"}})).contains("nope"));
        assert!(refusal(json!({"payload": {}})).contains("payload.kernel: required"));
        assert!(refusal(json!([])).contains("expected a JSON object"));
    }

    #[test]
    fn maps_vsock() {
        let vsock = |v: Value| {
            let mut b = json!({"payload": {"kernel": "builtin:spin"}});
            b["vsock"] = v;
            map(b)
        };
        let c = vsock(json!({"cid": 3, "socket": "/run/v.sock", "iommu": false, "id": "agent"}))
            .unwrap();
        let d = &c.devices.pci[0];
        assert_eq!(d.name.as_deref(), Some("agent"));
        assert!(matches!(&d.kind, lucid_vmm::PciDeviceKind::Vsock(v) if v.cid == 3));
        let refused = |v| vsock(v).unwrap_err().0;
        assert!(refused(json!({"socket": "/s"})).starts_with("vsock.cid: "));
        assert!(refused(json!({"cid": 3})).starts_with("vsock.socket: "));
        assert!(refused(json!({"cid": 1, "socket": "/s"})).contains("cid"));
        assert!(refused(json!({"cid": 3, "socket": "/s", "iommu": true})).contains("vsock.iommu"));
        assert!(
            refused(json!({"cid": 3, "socket": "/s", "pci_segment": 1})).contains("pci_segment")
        );
        assert!(refused(json!({"cid": 3, "socket": "/a,b"})).contains("comma"));
    }

    #[test]
    fn maps_rng() {
        let rng = |v: Value| {
            let mut b = json!({"payload": {"kernel": "builtin:spin"}});
            b["rng"] = v;
            map(b).unwrap().devices.rng.map(|r| r.rate)
        };
        assert_eq!(
            rng(json!({"src": "/dev/urandom", "iommu": false})),
            Some(None)
        );
        assert_eq!(rng(json!({})), Some(None));
        assert_eq!(rng(Value::Null), None);
        let c = map(json!({"payload": {"kernel": "builtin:spin"}, "lucid": {"rng": "rate=4096"}}))
            .unwrap();
        assert_eq!(c.devices.rng.and_then(|r| r.rate), Some(4096));
    }

    #[test]
    fn maps_console_to_the_virtio_console() {
        let console = |v: Value| {
            let mut b = json!({"payload": {"kernel": "builtin:spin"}});
            b["console"] = v;
            map(b).unwrap().devices.console.map(|c| c.output)
        };
        assert_eq!(console(json!({"mode": "Off"})), None);
        assert_eq!(console(json!({"mode": "Null"})), None);
        assert_eq!(console(json!({"mode": "Tty"})), Some(ConsoleOutput::Tty));
        assert_eq!(
            console(json!({"mode": "File", "file": "/tmp/c"})),
            Some(ConsoleOutput::File("/tmp/c".into()))
        );
        assert_eq!(
            console(json!({"mode": "Socket", "socket": "/tmp/s", "iommu": false})),
            Some(ConsoleOutput::Socket("/tmp/s".into()))
        );
        assert_eq!(console(Value::Null), None);
    }

    #[test]
    fn maps_user_devices() {
        let body = json!({
            "payload": {"kernel": "builtin:spin"},
            "memory": {"size": 128u64 << 20, "shared": true},
            "user_devices": [{"socket": "/run/edu.sock", "id": "edu0", "pci_segment": 0},
                             {"socket": "/run/b.sock"}],
        });
        let c = map(body).unwrap();
        let u = &c.devices.user_devices;
        assert_eq!(u.len(), 2);
        assert_eq!(u[0].socket, std::path::PathBuf::from("/run/edu.sock"));
        assert_eq!(u[0].id.as_deref(), Some("edu0"));
        assert_eq!(u[1].id, None);
        let e = refusal(json!({
            "payload": {"kernel": "builtin:spin"},
            "user_devices": [{"socket": "/s"}],
        }));
        assert!(e.contains("--backing memfd"), "{e}");
        for bad in [
            json!({"socket": "/s", "pci_segment": 1}),
            json!({"socket": "/a,b"}),
            json!({"id": "x"}),
            json!({"socket": "/s", "iommu": true}),
            json!({"socket": "/s", "colour": "red"}),
        ] {
            assert!(hot_user_device(bad.clone(), false).is_err(), "{bad}");
        }
        assert!(hot_user_device(json!({"socket": "/s", "iommu": true}), true).is_ok());
    }

    #[test]
    fn maps_vhost_user() {
        use lucid_virtio::vhost_user::VhostUserKind;
        use lucid_vmm::PciDeviceKind;
        let body = json!({
            "payload": {"kernel": "builtin:spin"},
            "memory": {"size": 128u64 << 20, "shared": true},
            "disks": [{"vhost_user": true, "vhost_socket": "/run/qsd.sock", "num_queues": 2,
                       "queue_size": 256, "id": "root"}],
            "fs": [{"tag": "share", "socket": "/run/vfsd.sock", "num_queues": 1,
                    "queue_size": 1024}],
            "net": [{"vhost_user": true, "vhost_socket": "/run/net.sock",
                     "mac": "52:54:00:00:00:01"}],
        });
        let c = map(body).unwrap();
        let kinds: Vec<_> = c
            .devices
            .pci
            .iter()
            .map(|d| match &d.kind {
                PciDeviceKind::VhostUser(v) => {
                    (v.kind.clone(), v.socket.clone(), v.num_queues, v.queue_size)
                }
                k => panic!("{k:?}"),
            })
            .collect();
        assert_eq!(
            kinds[0],
            (VhostUserKind::Blk, "/run/qsd.sock".into(), 2, 256)
        );
        assert_eq!(c.devices.pci[0].name.as_deref(), Some("root"));
        let fs = VhostUserKind::Fs {
            tag: "share".into(),
        };
        assert_eq!(kinds[2], (fs, "/run/vfsd.sock".into(), 1, 1024));
        let net = VhostUserKind::Net {
            mac: [0x52, 0x54, 0, 0, 0, 1],
        };
        assert_eq!(kinds[1], (net, "/run/net.sock".into(), 2, 128));
        // Without shared memory the configuration is refused, saying how to fix it.
        let e = refusal(json!({
            "payload": {"kernel": "builtin:spin"},
            "fs": [{"tag": "share", "socket": "/s"}],
        }));
        assert!(e.contains("--backing memfd"), "{e}");
        let e = refusal(json!({
            "payload": {"kernel": "builtin:spin"},
            "memory": {"size": 128u64 << 20, "shared": true},
            "disks": [{"vhost_user": true, "vhost_socket": "/s", "path": "/x"}],
        }));
        assert!(e.contains("disks[0].path"), "{e}");
    }

    #[test]
    fn maps_rate_limiter_config() {
        let body = |rl: Value| {
            json!({"payload": {"kernel": "builtin:spin"},
                   "disks": [{"path": "/tmp/r.img", "rate_limiter_config": rl}]})
        };
        let rl = json!({"bandwidth": {"size": 1000, "one_time_burst": 5, "refill_time": 100},
                        "ops": {"size": 10, "refill_time": 1000}});
        let c = map(body(rl)).unwrap();
        let got = c.devices.pci[0].rate_limiter.expect("limits");
        assert_eq!(got.bandwidth.map(|b| b.rate_per_s()), Some(10_000));
        assert_eq!(got.bandwidth.and_then(|b| b.one_time_burst), Some(5));
        assert_eq!(got.ops.map(|b| b.size), Some(10));
        assert_eq!(
            map(body(Value::Null)).unwrap().devices.pci[0].rate_limiter,
            None
        );
        let e = refusal(body(json!({"ops": {"size": 0, "refill_time": 1}})));
        assert!(e.starts_with("disks[0].rate_limiter_config: "), "{e}");
        let e = refusal(body(json!({"bw": 1})));
        assert!(e.starts_with("disks[0].rate_limiter_config: "), "{e}");
        let net = hot_device(
            "net",
            json!({"tap": "t0", "rate_limiter_config": {"ops": {"size": 1, "refill_time": 1}}}),
            false,
            0,
        )
        .unwrap();
        assert_eq!(
            net.rate_limiter.and_then(|r| r.ops).map(|o| o.rate_per_s()),
            Some(1000)
        );
    }

    /// What Kata's Cloud Hypervisor driver always sends (clh.go, CreateVM): a flat CPU
    /// topology, a platform object with its confidential-guest flags off, Raw disk images.
    #[test]
    fn accepts_what_kata_sends_at_lucids_values() {
        let kata = |cores: u64, segments: u64, image: &str| {
            map(json!({
                "payload": {"kernel": "builtin:spin"},
                "cpus": {"boot_vcpus": 2, "max_vcpus": 2, "kvm_hyperv": false, "nested": true,
                         "topology": {"threads_per_core": 1, "cores_per_die": cores,
                                      "dies_per_package": 1, "packages": 1}},
                "platform": {"num_pci_segments": segments, "tdx": false, "sev_snp": false},
                "disks": [{"path": "/tmp/k.img", "readonly": true, "image_type": image}],
            }))
        };
        let c = kata(2, 1, "Raw").unwrap();
        assert_eq!(c.machine.vcpus, 2);
        assert_eq!(c.devices.pci.len(), 1);
        let e = kata(4, 1, "Raw").expect_err("refused").0;
        assert!(e.contains("cpus.topology.cores_per_die"), "{e}");
        let e = kata(2, 2, "Raw").expect_err("refused").0;
        assert!(e.contains("platform.num_pci_segments"), "{e}");
        let e = kata(2, 1, "Qcow2").expect_err("refused").0;
        assert!(e.contains("disks[0].image_type"), "{e}");
        let tdx = json!({"payload": {"kernel": "builtin:spin"}, "platform": {"tdx": true}});
        assert!(refusal(tdx).contains("platform.tdx"));
    }

    #[test]
    fn refuses_impossible_values() {
        let zero = json!({"payload": {"kernel": "builtin:spin"}, "cpus": {"boot_vcpus": 0}});
        assert!(!refusal(zero).is_empty());
        let odd = json!({"payload": {"kernel": "builtin:spin"}, "memory": {"size": 1000}});
        assert!(refusal(odd).contains("memory.size"));
        let host = host_ram_mib().expect("/proc/meminfo");
        let big = json!({"payload": {"kernel": "builtin:spin"},
                         "memory": {"size": (host + 1) << 20}});
        assert!(refusal(big).contains("more than this host's RAM"));
        let dir = json!({"payload": {"kernel": "builtin:spin"}, "disks": [{"path": "/tmp"}]});
        assert!(refusal(dir).contains("disks[0].path: /tmp is a directory"));
    }
}
