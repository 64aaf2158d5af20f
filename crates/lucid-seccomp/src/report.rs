//! The report of a forbidden system call: a SIGSYS handler (the filters' action is
//! `SECCOMP_RET_TRAP`) that writes one line naming the thread, its role and the call to stderr,
//! then ends the process with [`VIOLATION_EXIT_STATUS`]. Everything it does is async-signal-safe:
//! it reads a thread-local set when the thread confined itself, formats into a stack buffer,
//! and makes two system calls every filter allows (`write`, `exit_group`).

use std::cell::Cell;

use crate::Role;

/// The exit status of a Lucid process stopped by a seccomp violation. Even, so no guest can
/// produce it through the debug-exit port (whose statuses are odd), and none of Lucid's others.
pub const VIOLATION_EXIT_STATUS: i32 = 148;

const NAME_MAX: usize = 32;

/// Who this thread is, for the handler: the thread's name and role (const-initialised and
/// without a destructor, so the handler's read is a plain TLS load).
#[derive(Clone, Copy)]
struct Identity {
    name: [u8; NAME_MAX],
    len: u8,
    role: Option<Role>,
}

thread_local! {
    static IDENTITY: Cell<Identity> = const {
        Cell::new(Identity { name: [0; NAME_MAX], len: 0, role: None })
    };
}

/// Records the calling thread's name and role for a report.
pub(crate) fn set_identity(role: Role) {
    let current = std::thread::current();
    let name = current.name().unwrap_or("unnamed").as_bytes();
    let len = name.len().min(NAME_MAX);
    let mut id = Identity {
        name: [0; NAME_MAX],
        len: len as u8,
        role: Some(role),
    };
    id.name[..len].copy_from_slice(&name[..len]);
    IDENTITY.with(|c| c.set(id));
}

/// `siginfo_t` as the kernel fills it for SIGSYS (`_sigsys` in linux/signal.h's union, at
/// offset 16 on 64-bit).
#[repr(C)]
struct SigsysInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    call_addr: usize,
    syscall: i32,
    arch: u32,
}

/// A fixed buffer that text is appended to without allocating.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Line {
    fn push(&mut self, s: &[u8]) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }

    fn push_num(&mut self, mut v: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}

/// The report for a forbidden call `nr` made by thread `name` in `role`.
fn report_line(name: &[u8], role: Option<Role>, nr: i64) -> Line {
    let mut l = Line {
        buf: [0; 256],
        len: 0,
    };
    l.push(b"lucid: seccomp: thread ");
    l.push(name);
    l.push(b" (role ");
    l.push(role.map_or("none", Role::name).as_bytes());
    l.push(b") made a forbidden system call: ");
    l.push(crate::names::name(nr).unwrap_or("unknown").as_bytes());
    l.push(b" (");
    if nr < 0 {
        l.push(b"-");
    }
    l.push_num(nr.unsigned_abs());
    l.push(b"); Lucid stops with exit status ");
    l.push_num(VIOLATION_EXIT_STATUS as u64);
    l.push(b" (see docs/security.md)\n");
    l
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the handler is installed with SA_SIGINFO, so `info` points at the siginfo the
    // kernel wrote for this SIGSYS, which has the `_sigsys` layout `SigsysInfo` mirrors.
    let nr = unsafe { (*info.cast::<SigsysInfo>()).syscall };
    let id = IDENTITY.with(|c| c.get());
    let line = report_line(&id.name[..id.len as usize], id.role, i64::from(nr));
    // SAFETY: write(2) of a live stack buffer and _exit(2) are async-signal-safe; nothing is
    // left to clean up, the process ends here (completed disk writes are already in the file).
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len);
        libc::_exit(VIOLATION_EXIT_STATUS);
    }
}

/// Installs the SIGSYS handler for the whole process.
pub(crate) fn install_handler() -> std::io::Result<()> {
    vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, on_sigsys)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_names_thread_role_and_call() {
        let l = report_line(b"lucid-vcpu0", Some(Role::Vcpu), 41);
        assert_eq!(
            std::str::from_utf8(&l.buf[..l.len]).unwrap(),
            "lucid: seccomp: thread lucid-vcpu0 (role vcpu) made a forbidden system call: \
             socket (41); Lucid stops with exit status 148 (see docs/security.md)\n"
        );
        let l = report_line(b"x", None, 9999);
        assert!(std::str::from_utf8(&l.buf[..l.len])
            .unwrap()
            .contains("(role none) made a forbidden system call: unknown (9999)"));
    }
}
