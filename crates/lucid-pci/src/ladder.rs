//! The exit ladder, decided in one place. From the rung a device asks for and what the host
//! offers, [`plan`] says everything the rung implies: how the driver's notifications reach the
//! back-end (an exit to userspace or an ioeventfd; the back-end waiting on kicks or polling), how
//! interrupts reach the guest (`KVM_SIGNAL_MSI` or irqfd), whether the VM offers PV EOI in CPUID
//! and whether the guest will see it, what Lucid must warn about, and which rungs it refuses. The
//! transport, the device's worker and the VM builder read the plan; none of them looks at the
//! rung itself.

use lucid_virtio::Notify;

use crate::msix::MsiPath;

/// The rung of the exit ladder a device runs on (chosen per device on the command line).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Rung {
    /// Notifications by userspace-handled exits; interrupts injected with `KVM_SIGNAL_MSI`.
    L0,
    /// ioeventfd notifications and irqfd interrupts: no return to userspace per I/O.
    #[default]
    L1,
    /// L1 plus PV EOI offered to the guest (only effective where CPUID is intercepted).
    L2,
    /// Posted interrupts (APICv); only where the host has them.
    L3,
    /// A polling back-end thread with guest notifications suppressed; with `guest_polls`, the
    /// guest polls the used ring too and asks for no interrupts.
    L4 { guest_polls: bool },
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad rung {0:?}: expected L0, L1, L2, L3, L4 or L4p")]
pub struct BadRung(pub String);

impl std::str::FromStr for Rung {
    type Err = BadRung;
    fn from_str(s: &str) -> Result<Self, BadRung> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "L0" => Rung::L0,
            "L1" => Rung::L1,
            "L2" => Rung::L2,
            "L3" => Rung::L3,
            "L4" => Rung::L4 { guest_polls: false },
            "L4P" | "L4-POLL" => Rung::L4 { guest_polls: true },
            _ => return Err(BadRung(s.to_string())),
        })
    }
}

impl Rung {
    /// The VM offers PV EOI in CPUID for this rung (L2 only, so that L1 and L2 differ where
    /// the guest reads Lucid's CPUID).
    pub fn offers_pv_eoi(self) -> bool {
        self == Rung::L2
    }

    /// The rung as a number for the counters: 0-4, 5 for L4 with guest polling.
    pub fn code(self) -> u64 {
        match self {
            Rung::L0 => 0,
            Rung::L1 => 1,
            Rung::L2 => 2,
            Rung::L3 => 3,
            Rung::L4 { guest_polls: false } => 4,
            Rung::L4 { guest_polls: true } => 5,
        }
    }
}

/// What the host offers that some rungs need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCaps {
    /// Guests read the CPUID the VMM sets (PV EOI reaches them).
    pub cpuid_intercepted: bool,
    /// APICv / AVIC.
    pub posted_interrupts: bool,
}

impl HostCaps {
    /// What `rungs` need to know about the host: whether it posts interrupts (`posted`, a cheap
    /// check), and whether guests read the VMM's CPUID (`cpuid_intercepted`, which runs a tiny
    /// VM), the latter only when some rung offers PV EOI.
    pub fn probe(
        rungs: impl IntoIterator<Item = Rung>,
        posted: impl FnOnce() -> bool,
        cpuid_intercepted: impl FnOnce() -> bool,
    ) -> HostCaps {
        HostCaps {
            posted_interrupts: posted(),
            cpuid_intercepted: vm_offers_pv_eoi(rungs) && cpuid_intercepted(),
        }
    }
}

/// Whether the VM offers PV EOI in CPUID: when some device's rung asks for it.
pub fn vm_offers_pv_eoi(rungs: impl IntoIterator<Item = Rung>) -> bool {
    rungs.into_iter().any(Rung::offers_pv_eoi)
}

/// What a rung means for the transport, the device and the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RungPlan {
    pub rung: Rung,
    /// Kicks by ioeventfd (else by the notify exit, handled in userspace).
    pub ioeventfd: bool,
    pub msi: MsiPath,
    /// How the device's back-end thread learns of new requests.
    pub notify: Notify,
    /// The VM must offer PV EOI in CPUID.
    pub pv_eoi: bool,
    /// ... and the guest will see it.
    pub pv_eoi_effective: bool,
}

/// A rung Lucid will not run on this host.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RungRefused {
    #[error(
        "L3 needs posted interrupts (APICv or AVIC), which this host's KVM does not offer; use \
         L1/L2 (irqfd) or L4 (polling)"
    )]
    NoPostedInterrupts,
}

/// A rung that runs, but not as its name promises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RungWarning {
    #[error(
        "rung L2 offers PV EOI in CPUID, but guests on this host read the host's CPUID (not \
         intercepted), so PV EOI is not in effect: L2 runs as L1 (counter pv_eoi.effective = 0)"
    )]
    PvEoiNotInEffect,
}

/// Decides what `rung` does on a host with `caps`; `poll_idle_us` is how long a polling
/// back-end sleeps when idle (0 spins).
pub fn plan(rung: Rung, caps: HostCaps, poll_idle_us: u32) -> Result<RungPlan, RungRefused> {
    let l1 = RungPlan {
        rung,
        ioeventfd: true,
        msi: MsiPath::Irqfd,
        notify: Notify::Kicks,
        pv_eoi: rung.offers_pv_eoi(),
        pv_eoi_effective: rung.offers_pv_eoi() && caps.cpuid_intercepted,
    };
    Ok(match rung {
        Rung::L0 => RungPlan {
            ioeventfd: false,
            msi: MsiPath::SignalMsi,
            ..l1
        },
        Rung::L1 | Rung::L2 => l1,
        // KVM posts irqfd interrupts into a running vCPU by itself where it can.
        Rung::L3 if caps.posted_interrupts => l1,
        Rung::L3 => return Err(RungRefused::NoPostedInterrupts),
        // The guest's driver chooses to poll and to ask for no interrupts; the device serves
        // L4 and L4p alike, and still sends the interrupts a driver asks for.
        Rung::L4 { .. } => RungPlan {
            notify: Notify::Poll {
                idle_sleep_us: poll_idle_us,
            },
            ..l1
        },
    })
}

impl RungPlan {
    /// What the user should be told about this plan, if anything.
    pub fn warning(&self) -> Option<RungWarning> {
        (self.pv_eoi && !self.pv_eoi_effective).then_some(RungWarning::PvEoiNotInEffect)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rungs_parse_and_refuse_garbage() {
        assert_eq!("l4p".parse(), Ok(Rung::L4 { guest_polls: true }));
        assert_eq!("L4".parse(), Ok(Rung::L4 { guest_polls: false }));
        assert_eq!("L5".parse::<Rung>(), Err(BadRung("L5".into())));
    }

    #[test]
    fn cpuid_is_probed_only_for_pv_eoi() {
        let probed = std::cell::Cell::new(false);
        let caps = HostCaps::probe(
            [Rung::L1, Rung::L4 { guest_polls: true }],
            || false,
            || {
                probed.set(true);
                true
            },
        );
        assert!(!probed.get() && !caps.cpuid_intercepted);
        let caps = HostCaps::probe([Rung::L1, Rung::L2], || false, || true);
        assert!(caps.cpuid_intercepted);
        assert!(vm_offers_pv_eoi([Rung::L0, Rung::L2]));
        assert!(!vm_offers_pv_eoi([Rung::L0, Rung::L1, Rung::L3]));
    }

    #[test]
    fn l2_warns_only_where_pv_eoi_cannot_work() {
        let none = HostCaps::default();
        let l2 = plan(Rung::L2, none, 0).unwrap();
        assert_eq!(l2.warning(), Some(RungWarning::PvEoiNotInEffect));
        let cpuid = HostCaps {
            cpuid_intercepted: true,
            ..none
        };
        assert_eq!(plan(Rung::L2, cpuid, 0).unwrap().warning(), None);
        assert_eq!(plan(Rung::L1, cpuid, 0).unwrap().warning(), None);
        assert!(!plan(Rung::L1, cpuid, 0).unwrap().pv_eoi_effective);
    }
}
