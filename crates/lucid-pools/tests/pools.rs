//! Pools on this host for real: cgroups made and removed with no leftovers, threads land
//! where the policy says (read back from the kernel), no-op admission one per CPU with a
//! waiting list, bad definitions and missing permission refused with nothing changed.
//!
//! Every test uses its own state directory and cgroup name (pid + tag), so tests run in
//! parallel with each other and with other Lucid processes. Tests that need root or the
//! cpuset v1 hierarchy skip (with a note) where it is missing, or fail in CI (`skip_or_fail`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use lucid_guests::skip_or_fail;
use lucid_pools::def::{
    create, destroy, Created, DefError, Destroyed, Policy, PoolSet, StateDir, VmRecord, VmThread,
};
use lucid_pools::place::{read_back, Backend, PlaceError, Placed, Placer};
use lucid_pools::policy::{
    admission_state, apply_boost, default_io_slice_ns, Admission, AdmissionFiles, AdmissionStatus,
    BoostLevel, SchedPolicy, IO_SLICE_NS,
};

const V1: &str = "/sys/fs/cgroup/cpuset";

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn have_v1() -> bool {
    Path::new(V1).join("cpuset.cpus").exists() && is_root()
}

/// A test's own state dir and cgroup name; tears down whatever is left on drop.
struct TestEnv {
    base: PathBuf,
    state: StateDir,
}

impl TestEnv {
    fn new(tag: &str) -> TestEnv {
        let id = format!("lucid-p1-{}-{tag}", std::process::id());
        let base = std::env::temp_dir().join(&id);
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        TestEnv {
            state: StateDir::new(base.join("state"), &id),
            base,
        }
    }
    fn cgroup_root(&self) -> PathBuf {
        Path::new(V1).join(&self.state.cgroup_name)
    }
    /// Every path under the test's base dir and the cgroup root (what "nothing changed" and
    /// "no leftovers" compare).
    fn snapshot(&self) -> BTreeSet<PathBuf> {
        let mut out = BTreeSet::new();
        walk(&self.base, &mut out);
        if self.cgroup_root().exists() {
            out.insert(self.cgroup_root());
            for e in std::fs::read_dir(self.cgroup_root()).unwrap().flatten() {
                if e.file_type().unwrap().is_dir() {
                    out.insert(e.path());
                }
            }
        }
        out
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let _ = destroy(&self.state, true);
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

fn walk(p: &Path, out: &mut BTreeSet<PathBuf>) {
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            out.insert(e.path());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path(), out);
            }
        }
    }
}

fn defs(d: &[&str]) -> PoolSet {
    PoolSet::parse_defs(d).unwrap()
}

/// A test's own env with pools `d` created on cpuset v1, and their placer; `None` (after
/// [`skip_or_fail`]) without root and the v1 hierarchy.
fn v1_pools(tag: &str, d: &[&str]) -> Option<(TestEnv, Placer)> {
    if !have_v1() {
        skip_or_fail("needs root and the cpuset v1 hierarchy");
        return None;
    }
    let env = TestEnv::new(tag);
    create(&env.state, &defs(d), Some(Backend::CpusetV1)).unwrap();
    let placer = Placer::open(&env.state).unwrap().unwrap();
    Some((env, placer))
}

/// A parked thread reporting its tid; ends when the handle is dropped.
struct Parked {
    tid: i32,
    stop: Option<mpsc::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Parked {
    fn spawn() -> Parked {
        let (tx, rx) = mpsc::channel();
        let (stop, wait) = mpsc::channel::<()>();
        let join = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = wait.recv();
        });
        Parked {
            tid: rx.recv().unwrap(),
            stop: Some(stop),
            join: Some(join),
        }
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        drop(self.stop.take());
        let _ = self.join.take().unwrap().join();
    }
}

/// Polls `f` until it holds (up to 2 s).
fn soon(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if f() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// Polls until admitted (up to 2 s). A freed slot can stay locked for a moment when another
/// test thread forks: the child holds a copy of the fd until it execs.
fn admitted_soon(a: &mut Admission) -> bool {
    soon(|| a.poll().unwrap())
}

/// `destroy` once a just-released slot is seen free (see [`admitted_soon`] for why it may
/// take a moment in a test process that forks).
fn destroy_soon(state: &StateDir) -> Destroyed {
    for _ in 0..200 {
        match destroy(state, false) {
            Err(DefError::InUse { .. }) => std::thread::sleep(std::time::Duration::from_millis(10)),
            r => return r.unwrap(),
        }
    }
    destroy(state, false).unwrap()
}

fn online() -> Vec<u32> {
    lucid_pools::def::online_cpus().unwrap()
}

#[test]
fn create_and_destroy_leave_no_leftovers_and_are_idempotent() {
    if !have_v1() {
        return skip_or_fail("needs root and the cpuset v1 hierarchy");
    }
    let env = TestEnv::new("life");
    let before = env.snapshot();
    let set = defs(&["name=io,cpus=0,policy=io", "name=cpu,cpus=1,policy=cpu"]);
    let created = create(&env.state, &set, Some(Backend::CpusetV1)).unwrap();
    assert!(matches!(created, Created::New(_)));
    let root = env.cgroup_root();
    let cpus = |p: &str| std::fs::read_to_string(root.join(p).join("cpuset.cpus")).unwrap();
    assert_eq!(cpus("io").trim(), "0");
    assert_eq!(cpus("cpu").trim(), "1");
    assert_eq!(cpus("").trim(), "0-1");
    assert!(env.state.pools_json().exists());
    // The same definition again changes nothing; a different one is refused.
    let mid = env.snapshot();
    assert!(matches!(
        create(&env.state, &set, Some(Backend::CpusetV1)).unwrap(),
        Created::Existing(_)
    ));
    let other = defs(&["name=io,cpus=0-1,policy=io"]);
    let e = create(&env.state, &other, Some(Backend::CpusetV1)).unwrap_err();
    assert!(matches!(e, DefError::Exists { .. }), "{e}");
    assert!(e.to_string().contains("lucid pools destroy"), "{e}");
    assert_eq!(env.snapshot(), mid);
    let placer = Placer::open(&env.state).unwrap().expect("pools defined");
    assert_eq!(placer.backend(), Backend::CpusetV1);
    assert_eq!(placer.pools().len(), 2);
    // Cgroups lost under pools.json (reboot with a persistent state dir): create repairs.
    std::fs::remove_dir(root.join("cpu")).unwrap();
    assert!(matches!(
        create(&env.state, &set, Some(Backend::CpusetV1)).unwrap(),
        Created::Repaired(_)
    ));
    assert_eq!(cpus("cpu").trim(), "1");
    assert_eq!(env.snapshot(), mid);

    assert_eq!(
        destroy(&env.state, false).unwrap(),
        Destroyed::Removed { evicted_vms: 0 }
    );
    assert!(!root.exists(), "cgroup root left behind");
    assert_eq!(env.snapshot(), before, "files left behind");
    assert_eq!(destroy(&env.state, false).unwrap(), Destroyed::Nothing);
    assert!(Placer::open(&env.state).unwrap().is_none());
}

#[test]
fn create_reuses_a_leftover_cgroup_of_a_crashed_create() {
    if !have_v1() {
        return skip_or_fail("needs root and the cpuset v1 hierarchy");
    }
    let env = TestEnv::new("leftover");
    // A create that died after making its cgroups, before writing pools.json.
    std::fs::create_dir(env.cgroup_root()).unwrap();
    std::fs::create_dir(env.cgroup_root().join("old")).unwrap();
    let set = defs(&["name=io,cpus=0,policy=io"]);
    create(&env.state, &set, Some(Backend::CpusetV1)).unwrap();
    assert!(!env.cgroup_root().join("old").exists());
    assert!(env.cgroup_root().join("io").exists());
    destroy(&env.state, false).unwrap();
    assert!(!env.cgroup_root().exists());
}

#[test]
fn racing_creates_make_one_set_of_pools() {
    if !have_v1() {
        return skip_or_fail("needs root and the cpuset v1 hierarchy");
    }
    let env = TestEnv::new("race");
    let before = env.snapshot();
    let set = defs(&["name=io,cpus=0,policy=io", "name=cpu,cpus=1,policy=cpu"]);
    let results: Vec<Created> = (0..4)
        .map(|_| {
            let (st, set) = (env.state.clone(), set.clone());
            std::thread::spawn(move || create(&st, &set, Some(Backend::CpusetV1)).unwrap())
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let new = results
        .iter()
        .filter(|c| matches!(c, Created::New(_)))
        .count();
    assert_eq!(new, 1, "{results:?}");
    assert!(env.cgroup_root().join("io").exists());
    let (a, b) = (env.state.clone(), env.state.clone());
    let d1 = std::thread::spawn(move || destroy(&a, false).unwrap());
    let d2 = std::thread::spawn(move || destroy(&b, false).unwrap());
    let mut ds = [d1.join().unwrap(), d2.join().unwrap()];
    ds.sort_by_key(|d| matches!(d, Destroyed::Nothing));
    assert_eq!(
        ds,
        [Destroyed::Removed { evicted_vms: 0 }, Destroyed::Nothing]
    );
    assert_eq!(env.snapshot(), before);
}

#[test]
fn threads_land_where_the_policy_says_cpuset_v1() {
    let Some((env, placer)) = v1_pools(
        "land",
        &["name=io,cpus=0,policy=io", "name=cpu,cpus=1,policy=cpu"],
    ) else {
        return;
    };
    let cg = |p: &str| format!("/{}/{p}", env.state.cgroup_name);
    let a = Parked::spawn();
    let b = Parked::spawn();
    // sched_getattr reports the effective slice: the default one unless a thread asked.
    let default_slice = read_back(a.tid).unwrap().slice_ns;

    assert!(matches!(
        placer.place_thread(a.tid, "io").unwrap(),
        Placed::Policy(_)
    ));
    let r = read_back(a.tid).unwrap();
    assert_eq!(r.affinity, vec![0]);
    assert_eq!(r.cgroup, cg("io"));
    assert_eq!(r.policy, SchedPolicy::Other);
    // Kernel 6.12+ keeps the short slice (shorter than the default); older ones get nice -5.
    let io_slice = default_io_slice_ns();
    assert!(
        io_slice <= IO_SLICE_NS && io_slice < default_slice,
        "{io_slice} {default_slice}"
    );
    assert!(
        (r.slice_ns == io_slice && r.nice == 0) || r.nice == -5,
        "{r:?}"
    );

    // The monitor's wake boost steps the nice down and keeps the class and slice.
    let Placed::Policy(applied) = placer.place_thread(a.tid, "io").unwrap() else {
        panic!("io is not a no-op pool")
    };
    let io_slice = read_back(a.tid).unwrap().slice_ns;
    apply_boost(a.tid, &applied, BoostLevel::Boost2).unwrap();
    let r = read_back(a.tid).unwrap();
    assert_eq!(
        (r.policy, r.nice, r.slice_ns),
        (SchedPolicy::Other, applied.nice - 2, io_slice)
    );
    apply_boost(a.tid, &applied, BoostLevel::Under).unwrap();
    assert_eq!(read_back(a.tid).unwrap().nice, applied.nice);

    placer.place_thread(b.tid, "cpu").unwrap();
    let r = read_back(b.tid).unwrap();
    assert_eq!(r.affinity, vec![1]);
    assert_eq!(r.cgroup, cg("cpu"));
    assert_eq!(r.policy, SchedPolicy::Batch);
    assert_eq!(r.nice, 10);

    // Moving a thread between pools: no pause, the new pool's policy applies.
    placer.place_thread(a.tid, "cpu").unwrap();
    let r = read_back(a.tid).unwrap();
    assert_eq!((r.affinity, r.cgroup.clone()), (vec![1], cg("cpu")));
    assert_eq!(
        (r.policy, r.nice, r.slice_ns),
        (SchedPolicy::Batch, 10, default_slice)
    );

    // Destroy refuses while threads are in the pools, and --force evicts them.
    let e = destroy(&env.state, false).unwrap_err();
    assert!(matches!(e, DefError::InUse { .. }), "{e}");
    assert!(env.cgroup_root().join("cpu").exists());
    placer.unplace(b.tid).unwrap();
    let r = read_back(b.tid).unwrap();
    assert_eq!(
        (r.affinity, r.cgroup.as_str(), r.policy),
        (online(), "/", SchedPolicy::Other)
    );
    destroy(&env.state, true).unwrap();
    let r = read_back(a.tid).unwrap();
    assert_eq!(
        (r.affinity, r.cgroup.as_str(), r.policy, r.nice),
        (online(), "/", SchedPolicy::Other, 0)
    );
    assert!(!env.cgroup_root().exists());
    assert!(!env.state.dir.exists());
}

#[test]
fn threads_land_where_the_policy_says_affinity() {
    if !is_root() {
        return skip_or_fail("needs root");
    }
    let env = TestEnv::new("aff");
    let set = defs(&[
        "name=io,cpus=0,policy=io",
        "name=dflt,cpus=1,policy=default",
    ]);
    let c = create(&env.state, &set, Some(Backend::Affinity)).unwrap();
    assert_eq!(c.host().cgroup, None);
    assert!(!env.cgroup_root().exists());
    let placer = Placer::open(&env.state).unwrap().unwrap();
    let t = Parked::spawn();
    let cg_before = read_back(t.tid).unwrap().cgroup;
    placer.place_thread(t.tid, "dflt").unwrap();
    let r = read_back(t.tid).unwrap();
    assert_eq!(
        (r.affinity, r.policy, r.nice),
        (vec![1], SchedPolicy::Other, 0)
    );
    assert_eq!(
        r.cgroup, cg_before,
        "the affinity backend leaves cgroups alone"
    );
    let e = placer.place_thread(t.tid, "nope").unwrap_err();
    assert!(matches!(e, PlaceError::NoPool(..)), "{e}");
    // A VM listing the thread keeps destroy from going ahead; --force resets it.
    let mut rec = VmRecord::for_self("t");
    rec.threads.push(VmThread {
        tid: t.tid,
        name: "t".into(),
        role: "vcpu0".into(),
        pool: Some("dflt".into()),
        admission: None,
    });
    env.state.write_vm(&rec).unwrap();
    assert!(matches!(
        destroy(&env.state, false),
        Err(DefError::InUse { live: 1, .. })
    ));
    assert_eq!(
        destroy(&env.state, true).unwrap(),
        Destroyed::Removed { evicted_vms: 1 }
    );
    assert_eq!(read_back(t.tid).unwrap().affinity, online());
    // The live VM's own file stays until the VM exits.
    env.state.remove_vm(rec.pid);
    assert_eq!(destroy(&env.state, false).unwrap(), Destroyed::Nothing);
    assert!(!env.state.dir.exists());
}

#[test]
fn noop_admits_one_per_cpu_and_queues_the_rest() {
    let Some((env, placer)) = v1_pools(
        "noop",
        &[
            "name=be,cpus=1,policy=noop",
            "name=vm,cpus=0,policy=default",
        ],
    ) else {
        return;
    };
    let (t1, t2, t3) = (Parked::spawn(), Parked::spawn(), Parked::spawn());
    let noop = |t: &Parked| match placer.place_thread(t.tid, "be").unwrap() {
        Placed::Noop(a) => a,
        p => panic!("{p:?}"),
    };
    let a1 = noop(&t1);
    assert_eq!(a1.status(), AdmissionStatus::Admitted { cpu: 1 });
    assert_eq!(placer.backend_pool().map(|p| p.name.as_str()), Some("be"));
    assert_eq!(a1.cpu(), Some(1));
    let r = read_back(t1.tid).unwrap();
    assert_eq!((r.policy, r.priority), (SchedPolicy::Fifo, 10));
    assert_eq!(r.affinity, vec![1]);
    assert_eq!(r.cgroup, format!("/{}/be", env.state.cgroup_name));

    // The pool is full: the next threads wait where they are, in order.
    let unplaced = read_back(t2.tid).unwrap();
    let mut a2 = noop(&t2);
    let mut a3 = noop(&t3);
    assert!(!a2.is_admitted() && !a3.is_admitted());
    assert_eq!(a2.status(), AdmissionStatus::Waiting);
    assert_eq!(
        read_back(t2.tid).unwrap(),
        unplaced,
        "a waiter is left alone"
    );
    let be = placer.pool("be").unwrap().clone();
    let (slots, waiters) = admission_state(&env.state, &be);
    assert_eq!(slots[0].holder, Some((std::process::id() as i32, t1.tid)));
    assert_eq!(
        waiters.iter().map(|w| w.1).collect::<Vec<_>>(),
        vec![t2.tid, t3.tid]
    );
    assert!(!a3.poll().unwrap(), "t2 is first in line");
    assert!(!a2.poll().unwrap(), "no slot is free");

    // A slot frees: the oldest waiter is admitted, the other keeps waiting.
    a1.release().unwrap();
    assert_eq!(read_back(t1.tid).unwrap().policy, SchedPolicy::Other);
    assert!(!a3.poll().unwrap());
    assert!(admitted_soon(&mut a2));
    let r = read_back(t2.tid).unwrap();
    assert_eq!((r.policy, r.affinity.clone()), (SchedPolicy::Fifo, vec![1]));
    assert!(!a3.poll().unwrap());
    // An admission dropped without release (its thread exited) frees the slot too.
    drop(a2);
    assert!(admitted_soon(&mut a3));
    assert_eq!(read_back(t3.tid).unwrap().policy, SchedPolicy::Fifo);
    let (slots, waiters) = admission_state(&env.state, &be);
    assert_eq!(slots[0].holder.map(|h| h.1), Some(t3.tid));
    assert!(waiters.is_empty());
    // The admitted thread exits: its owner sees it and drops the admission.
    assert!(!a3.thread_exited());
    drop(t3);
    // (join returns when the tid is cleared, a moment before the kernel drops the task)
    assert!(soon(|| a3.thread_exited()));
    drop(a3);
    placer.unplace(t2.tid).unwrap();
    destroy_soon(&env.state);
    assert!(!env.state.dir.exists() && !env.cgroup_root().exists());
}

/// Starts `cmd` (which prints one line once it holds its lock) and waits for that line.
fn holder(program: &str, args: &[&str]) -> std::process::Child {
    use std::io::BufRead;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "locked");
    child
}

#[test]
fn noop_slots_and_queue_are_host_wide_and_survive_crashed_holders() {
    let tools = ["/usr/bin/flock", "/usr/bin/python3"];
    if !have_v1() || tools.iter().any(|t| !Path::new(t).exists()) {
        return skip_or_fail("needs root, the cpuset v1 hierarchy, flock(1) and python3");
    }
    let env = TestEnv::new("xproc");
    let set = defs(&["name=be,cpus=1,policy=noop"]);
    create(&env.state, &set, Some(Backend::CpusetV1)).unwrap();
    let placer = Placer::open(&env.state).unwrap().unwrap();
    std::fs::create_dir_all(env.state.slots_dir()).unwrap();
    // Another process holds CPU 1's slot (as another Lucid process would): the shell locks
    // fd 9 and becomes `sleep`, keeping it.
    let slot = env.state.slots_dir().join("be.1");
    let mut slot_holder = holder(
        "/bin/sh",
        &[
            "-c",
            &format!(
                "exec 9>>'{}'; /usr/bin/flock 9; echo locked; exec sleep 30",
                slot.display()
            ),
        ],
    );
    // And another process waits in line before us (a POSIX record lock on ticket 0).
    let queue = env.state.slots_dir().join("be.queue");
    let mut older_waiter = holder(
        "/usr/bin/python3",
        &[
            "-c",
            &format!(
                "import fcntl,os,time\nfd=os.open('{}',os.O_RDWR|os.O_CREAT)\n\
                 fcntl.lockf(fd,fcntl.LOCK_EX|fcntl.LOCK_NB,16,64)\nprint('locked',flush=True)\n\
                 time.sleep(30)",
                queue.display()
            ),
        ],
    );
    let t = Parked::spawn();
    let mut adm = Admission::request(placer.clone(), t.tid, "be").unwrap();
    assert!(!adm.is_admitted());
    let be = placer.pool("be").unwrap().clone();
    let (slots, waiters) = admission_state(&env.state, &be);
    assert!(slots[0].held, "{slots:?}");
    assert_eq!(waiters.len(), 2, "{waiters:?}");
    assert_eq!(waiters[1], (std::process::id() as i32, t.tid));
    // The slot holder crashes: the kernel drops its lock (the slot is seen free), but the older
    // waiter goes first.
    slot_holder.kill().unwrap();
    slot_holder.wait().unwrap();
    assert!(
        soon(|| !admission_state(&env.state, &be).0[0].held),
        "the crashed holder's slot stayed locked"
    );
    assert!(
        !adm.poll().unwrap(),
        "an older live waiter is first in line"
    );
    // The older waiter crashes too: its ticket goes with it and we are admitted.
    older_waiter.kill().unwrap();
    older_waiter.wait().unwrap();
    assert!(admitted_soon(&mut adm));
    assert_eq!(read_back(t.tid).unwrap().policy, SchedPolicy::Fifo);
    let (_, waiters) = admission_state(&env.state, &be);
    assert!(waiters.is_empty(), "{waiters:?}");
    adm.release().unwrap();
    destroy_soon(&env.state);
    assert!(!env.state.dir.exists());
}

/// Confines the calling thread (only it) with a seccomp filter that fails every call that
/// opens, creates, renames or removes a file or lists a directory with EPERM: what a
/// Lucid thread under its seccomp role cannot do either.
fn deny_file_namespace_calls() {
    let deny: [i64; 13] = [
        libc::SYS_open,
        libc::SYS_openat,
        libc::SYS_openat2,
        libc::SYS_creat,
        libc::SYS_unlink,
        libc::SYS_unlinkat,
        libc::SYS_rename,
        libc::SYS_renameat,
        libc::SYS_renameat2,
        libc::SYS_mkdir,
        libc::SYS_mkdirat,
        libc::SYS_getdents64,
        libc::SYS_rmdir,
    ];
    let n = deny.len();
    let stmt = |code: u16, k: u32| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let mut prog = vec![stmt(0x20, 0)]; // ld [nr]
    for (i, nr) in deny.iter().enumerate() {
        prog.push(libc::sock_filter {
            code: 0x15, // jeq #nr
            jt: (n - i) as u8,
            jf: 0,
            k: *nr as u32,
        });
    }
    prog.push(stmt(0x06, 0x7fff_0000)); // ret ALLOW
    prog.push(stmt(0x06, 0x0005_0000 | libc::EPERM as u32)); // ret ERRNO(EPERM)
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: prctl/seccomp on the calling thread with a valid program that outlives the call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                &fprog as *const libc::sock_fprog
            ),
            0
        );
    }
}

#[test]
fn a_confined_thread_can_place_poll_and_publish() {
    if !have_v1() {
        return skip_or_fail("needs root and the cpuset v1 hierarchy");
    }
    let env = TestEnv::new("confined");
    let set = defs(&["name=be,cpus=1,policy=noop", "name=vm,cpus=0,policy=io"]);
    create(&env.state, &set, Some(Backend::CpusetV1)).unwrap();
    // Opened before confinement, as the VMM does before its threads confine themselves.
    let placer = Placer::open(&env.state).unwrap().unwrap();
    let publ = lucid_pools::def::VmPublisher::new(&env.state).unwrap();
    let (t1, t2, t3) = (Parked::spawn(), Parked::spawn(), Parked::spawn());
    let a1 = Admission::request(placer.clone(), t1.tid, "be").unwrap();
    let a2 = Admission::request(placer.clone(), t2.tid, "be").unwrap();
    assert!(a1.is_admitted() && !a2.is_admitted());
    let (p, tid3) = (placer.clone(), t3.tid);
    let mut rec = VmRecord::for_self("confined");
    let path = publ.path().to_path_buf();
    let (a2, publ) = std::thread::spawn(move || {
        let mut a2 = a2;
        deny_file_namespace_calls();
        assert!(
            std::fs::File::open("/proc/self/status").is_err(),
            "filter works"
        );
        p.place_thread(tid3, "vm").unwrap();
        rec.pool = Some("vm".into());
        publ.publish(&rec).unwrap();
        a1.release().unwrap();
        assert!(soon(|| a2.poll().unwrap()), "admitted once the slot freed");
        (a2, publ)
    })
    .join()
    .unwrap();
    let r = read_back(t3.tid).unwrap();
    assert_eq!((r.affinity, r.policy), (vec![0], SchedPolicy::Other));
    assert_eq!(r.cgroup, format!("/{}/vm", env.state.cgroup_name));
    let r = read_back(t2.tid).unwrap();
    assert_eq!((r.affinity, r.policy), (vec![1], SchedPolicy::Fifo));
    assert_eq!(read_back(t1.tid).unwrap().policy, SchedPolicy::Other);
    assert_eq!(env.state.vms(true)[0].pool.as_deref(), Some("vm"));
    drop(publ);
    assert_eq!(std::fs::read_to_string(path).unwrap(), "");
    drop(a2);
    placer.unplace(t2.tid).unwrap();
    placer.unplace(t3.tid).unwrap();
    destroy_soon(&env.state);
    assert!(!env.state.dir.exists());
}

/// Admission files opened ahead serve a thread confined without `open` (a back-end started by a
/// confined vCPU), and go back to the pool of spare files when its thread ends: the next
/// thread asks with them and queues behind older waiters.
#[test]
fn admission_files_opened_ahead_serve_confined_threads_and_are_reused() {
    let Some((env, placer)) = v1_pools(
        "files",
        &["name=be,cpus=1,policy=noop", "name=vm,cpus=0,policy=io"],
    ) else {
        return;
    };
    let files: Vec<AdmissionFiles> = (0..2)
        .map(|_| AdmissionFiles::open(&placer, "be").unwrap())
        .collect();
    let (t1, t2, t3) = (Parked::spawn(), Parked::spawn(), Parked::spawn());
    let (p, tids) = (placer.clone(), [t1.tid, t2.tid, t3.tid]);
    let (a2, a3) = std::thread::spawn(move || {
        deny_file_namespace_calls();
        let mut files = files;
        let a1 = Admission::request_with(p.clone(), tids[0], files.pop().unwrap()).unwrap();
        let mut a2 = Admission::request_with(p.clone(), tids[1], files.pop().unwrap()).unwrap();
        assert!(a1.is_admitted() && !a2.is_admitted());
        // t1 ends: its files serve t3, which queues behind t2.
        let again = a1.into_files();
        assert_eq!(again.pool(), "be");
        let mut a3 = Admission::request_with(p, tids[2], again).unwrap();
        assert!(!a3.poll().unwrap(), "t2 is first in line");
        assert!(admitted_soon(&mut a2));
        assert!(!a3.poll().unwrap(), "one slot");
        (a2, a3)
    })
    .join()
    .unwrap();
    assert_eq!(read_back(t2.tid).unwrap().policy, SchedPolicy::Fifo);
    assert_eq!(a3.status(), AdmissionStatus::Waiting);
    let be = placer.pool("be").unwrap().clone();
    let (slots, waiters) = admission_state(&env.state, &be);
    assert_eq!(slots[0].holder.map(|h| h.1), Some(t2.tid));
    assert_eq!(
        waiters.iter().map(|w| w.1).collect::<Vec<_>>(),
        vec![t3.tid]
    );
    drop(a3);
    a2.release().unwrap();
    for t in [&t1, &t2, &t3] {
        let _ = placer.unplace(t.tid);
    }
    destroy_soon(&env.state);
    assert!(!env.state.dir.exists());
}

/// A back-end that cannot be pinned when its turn comes (here: it exited) does not keep the
/// slot, and a refused request hands its files back (a confined VM has no others).
#[test]
fn an_admission_that_cannot_pin_frees_the_slot_and_keeps_its_files() {
    let Some((env, placer)) = v1_pools(
        "pinfail",
        &["name=be,cpus=1,policy=noop", "name=vm,cpus=0,policy=io"],
    ) else {
        return;
    };
    let (t1, t3) = (Parked::spawn(), Parked::spawn());
    let t2 = Parked::spawn();
    let a1 = Admission::request(placer.clone(), t1.tid, "be").unwrap();
    let mut a2 = Admission::request(placer.clone(), t2.tid, "be").unwrap();
    assert!(a1.is_admitted() && !a2.is_admitted());
    let gone = t2.tid;
    drop(t2);
    a1.release().unwrap();
    // t2's turn: it cannot be pinned, so it must not hold the CPU.
    let mut err = None;
    for _ in 0..200 {
        match a2.poll() {
            Err(e) => {
                err = Some(e);
                break;
            }
            Ok(admitted) => assert!(!admitted, "an exited thread is never admitted"),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        matches!(err, Some(PlaceError::NoThread(t)) if t == gone),
        "{err:?}"
    );
    assert!(!a2.is_admitted());
    drop(a2);
    // A refused request returns its files, which then serve the next thread.
    let files = AdmissionFiles::open(&placer, "be").unwrap();
    let refused = Admission::request_with(placer.clone(), gone, files).unwrap_err();
    assert!(
        matches!(refused.error, PlaceError::NoThread(_)),
        "{refused}"
    );
    assert_eq!(refused.files.pool(), "be");
    let mut a3 = Admission::request(placer.clone(), t3.tid, "be").unwrap();
    assert!(admitted_soon(&mut a3), "the slot t2 could not use is free");
    let t4 = Parked::spawn();
    let a4 = Admission::request_with(placer.clone(), t4.tid, refused.files).unwrap();
    assert_eq!(
        a4.status(),
        AdmissionStatus::Waiting,
        "t3 holds the one CPU"
    );
    drop(a4);
    a3.release().unwrap();
    for t in [&t1, &t3, &t4] {
        let _ = placer.unplace(t.tid);
    }
    destroy_soon(&env.state);
    assert!(!env.state.dir.exists());
}

/// A process that stops while it holds the waiting list's header (mid-draw) does not hang a
/// back-end asking for admission: the request fails after a bounded wait, its files come back,
/// and the next request goes through once the header is free.
#[test]
fn a_held_waiting_list_does_not_hang_a_request() {
    let Some((env, placer)) = v1_pools("held", &["name=be,cpus=1,policy=noop"]) else {
        return;
    };
    let files = AdmissionFiles::open(&placer, "be").unwrap();
    // Another open file description holds the header, as a stopped drawer would.
    let other = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(env.state.slots_dir().join("be.queue"))
        .unwrap();
    let header = |kind: i32| {
        // SAFETY: a zeroed flock is a valid request once its fields are set.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_len = 8;
        // SAFETY: fcntl F_OFD_SETLK with a valid struct flock on an fd we own.
        let r = unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&other),
                libc::F_OFD_SETLK,
                &mut fl,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    };
    header(libc::F_WRLCK);
    let t = Parked::spawn();
    let start = std::time::Instant::now();
    let refused = Admission::request_with(placer.clone(), t.tid, files).unwrap_err();
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    assert!(refused.to_string().contains("be.queue"), "{refused}");
    assert!(
        format!("{:?}", refused.error).contains("TimedOut"),
        "{:?}",
        refused.error
    );
    header(libc::F_UNLCK);
    let a = Admission::request_with(placer.clone(), t.tid, refused.files).unwrap();
    assert!(a.is_admitted());
    a.release().unwrap();
    drop(t);
    destroy_soon(&env.state);
}

/// A corrupt `pools.json` (a pool name that climbs out of the cgroup root, a root of `/`)
/// is refused with how to fix it, never panics or names paths outside the pools; `destroy
/// --force` removes it.
#[test]
fn a_corrupt_pools_json_is_refused_and_destroy_force_removes_it() {
    let env = TestEnv::new("corrupt");
    std::fs::create_dir_all(&env.state.dir).unwrap();
    let bad = [
        r#"{"pools":[{"name":"../x","cpus":[0],"policy":"io"}],"backend":"cpuset-v1","cgroup":"/sys/fs/cgroup/cpuset/t","created":0}"#,
        r#"{"pools":[{"name":"a","cpus":[0],"policy":"io"}],"backend":"cpuset-v1","cgroup":"/","created":0}"#,
        r#"{"pools":[{"name":"a","cpus":[],"policy":"io"}],"backend":"affinity","cgroup":null,"created":0}"#,
        r#"{"pools":[{"name":"a","cpus":[0],"policy":"io"},{"name":"b","cpus":[0],"policy":"cpu"}],"backend":"affinity","cgroup":null,"created":0}"#,
        r#"{"pools":[{"name":"a","cpus":[0],"policy":"io"}],"backend":"affinity","cgroup":"/sys/fs/cgroup/cpuset/t/../..","created":0}"#,
        "{not json",
    ];
    for text in bad {
        std::fs::write(env.state.pools_json(), text).unwrap();
        let e = env.state.load().unwrap_err();
        assert!(matches!(e, DefError::Corrupt { .. }), "{text}: {e}");
        assert!(e.to_string().contains("destroy --force"), "{e}");
        assert!(Placer::open(&env.state).is_err(), "{text}");
        assert!(matches!(
            destroy(&env.state, false),
            Err(DefError::Corrupt { .. })
        ));
        assert!(env.state.pools_json().exists(), "refused: nothing changed");
        assert_eq!(
            destroy(&env.state, true).unwrap(),
            Destroyed::Removed { evicted_vms: 0 }
        );
        assert!(!env.state.dir.exists(), "{text}");
        std::fs::create_dir_all(&env.state.dir).unwrap();
    }
}

/// `destroy --force` resets only threads of the VM processes: a record listing tid 0 (the
/// caller) or another process's thread leaves them alone.
#[test]
fn destroy_force_leaves_threads_a_record_does_not_own() {
    let env = TestEnv::new("forged");
    let set = defs(&["name=a,cpus=0,policy=io"]);
    create(&env.state, &set, Some(Backend::Affinity)).unwrap();
    let t = Parked::spawn();
    lucid_pools::place::set_affinity(t.tid, &[0]).unwrap();
    let mut rec = VmRecord::for_self("forged");
    for tid in [0, 1] {
        rec.threads.push(VmThread {
            tid,
            name: "x".into(),
            role: "vcpu0".into(),
            pool: Some("a".into()),
            admission: None,
        });
    }
    env.state.write_vm(&rec).unwrap();
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    let mine = read_back(me).unwrap().affinity;
    lucid_pools::place::set_affinity(me, &[0]).unwrap();
    destroy(&env.state, true).unwrap();
    let after = read_back(me).unwrap().affinity;
    lucid_pools::place::set_affinity(me, &mine).unwrap();
    assert_eq!(after, vec![0], "tid 0 is the caller: untouched");
    assert_eq!(
        read_back(t.tid).unwrap().affinity,
        vec![0],
        "not listed: untouched"
    );
    assert!(lucid_pools::def::is_thread_of(rec.pid, t.tid));
    assert!(!lucid_pools::def::is_thread_of(rec.pid, 1));
    env.state.remove_vm(rec.pid);
}

#[test]
fn bad_definitions_are_refused_and_change_nothing() {
    let env = TestEnv::new("bad");
    let before = env.snapshot();
    let bad: &[(&[&str], &str)] = &[
        (&["name=a,cpus=4095,policy=io"], "not online"),
        (
            &["name=a,cpus=0,policy=io", "name=b,cpus=0,policy=cpu"],
            "overlap",
        ),
        (&["name=a,cpus=,policy=io"], "no CPUs"),
        (
            &["name=a,cpus=0,policy=io", "name=a,cpus=1,policy=io"],
            "twice",
        ),
        (&["name=a,cpus=0,policy=realtime"], "unknown policy"),
        (&["name=a/b,cpus=0,policy=io"], "bad pool name"),
        (&["name=a,cpus=x,policy=io"], "bad CPU list"),
        (&["name=a,cpus=0"], "policy=noop|io|cpu|default is required"),
        (&[], "no pools"),
    ];
    for (d, want) in bad {
        let e = PoolSet::parse_defs(d).unwrap_err();
        assert!(e.to_string().contains(want), "{d:?}: {e}");
        assert_eq!(env.snapshot(), before, "{d:?} changed something");
    }
    // create() revalidates a set built by hand (e.g. from old JSON) the same way.
    let set = PoolSet {
        pools: vec![lucid_pools::def::PoolDef {
            name: "a".into(),
            cpus: vec![4000],
            policy: Policy::Io,
            backends: false,
            slice_us: None,
        }],
    };
    let e = create(&env.state, &set, Some(Backend::Affinity)).unwrap_err();
    assert!(matches!(e, DefError::OfflineCpu { .. }), "{e}");
    // A backend the host lacks (here: cgroup v2 without cpuset) is refused the same way.
    if !Path::new("/sys/fs/cgroup/unified/cgroup.controllers").exists()
        || !std::fs::read_to_string("/sys/fs/cgroup/unified/cgroup.controllers")
            .unwrap()
            .contains("cpuset")
    {
        let ok = defs(&["name=a,cpus=0,policy=io"]);
        let e = create(&env.state, &ok, Some(Backend::CpusetV2)).unwrap_err();
        assert!(e.to_string().contains("cpuset-v2"), "{e}");
    }
    assert_eq!(env.snapshot(), before);
    assert!(!env.cgroup_root().exists());
}

/// Runs `f` on a thread whose uid/gid are `nobody` (the raw syscalls change only this
/// thread's credentials, unlike libc's setuid).
fn as_nobody<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: raw setresgid/setresuid on the calling thread only; no memory passed.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_setresgid, 65534, 65534, 65534), 0);
            assert_eq!(libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534), 0);
        }
        f()
    })
    .join()
    .unwrap()
}

#[test]
fn no_permission_is_refused_and_changes_nothing() {
    if !have_v1() {
        return skip_or_fail("needs root (to drop to nobody) and the cpuset v1 hierarchy");
    }
    let env = TestEnv::new("perm");
    let set = defs(&["name=io,cpus=0,policy=io"]);
    let before = env.snapshot();
    // 1. The state directory cannot be made (its parent is root's, mode 0755).
    let (st, s2) = (env.state.clone(), set.clone());
    let e = as_nobody(move || create(&st, &s2, Some(Backend::CpusetV1)).map(|_| ()));
    let e = e.unwrap_err();
    assert!(matches!(e, DefError::Permission { .. }), "{e}");
    assert!(e.to_string().contains("run as root"), "{e}");
    assert_eq!(env.snapshot(), before);
    // 2. The state directory can be made but the cgroup cannot: what was made is undone.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&env.base, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (st, s2) = (env.state.clone(), set.clone());
    let e = as_nobody(move || create(&st, &s2, Some(Backend::CpusetV1)).map(|_| ()));
    let e = e.unwrap_err();
    assert!(e.to_string().contains("permission"), "{e}");
    assert_eq!(env.snapshot(), before, "a refused create left something");
    assert!(!env.state.dir.exists());
    // 3. Placing or setting a policy without permission fails clearly.
    create(&env.state, &set, Some(Backend::CpusetV1)).unwrap();
    let placer = Placer::open(&env.state).unwrap().unwrap();
    let t = Parked::spawn();
    let tid = t.tid;
    let e = as_nobody(move || placer.place_thread(tid, "io").map(|_| ())).unwrap_err();
    assert!(matches!(e, PlaceError::Permission { .. }), "{e}");
    assert_eq!(read_back(t.tid).unwrap().cgroup, "/");
    destroy(&env.state, false).unwrap();
}

/// Runs `f` on a thread with its own mount namespace in which `dir` is read-only (only that
/// thread sees it so; the namespace goes with the thread).
fn with_read_only<T: Send + 'static>(dir: &Path, f: impl FnOnce() -> T + Send + 'static) -> T {
    use std::ffi::CString;
    let d = CString::new(dir.as_os_str().to_str().unwrap()).unwrap();
    std::thread::spawn(move || {
        let root = CString::new("/").unwrap();
        // SAFETY: unshare/mount on this thread with valid C strings; the new namespace is
        // private, so nothing propagates to the host.
        unsafe {
            assert_eq!(libc::unshare(libc::CLONE_NEWNS), 0, "unshare");
            assert_eq!(
                libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null()
                ),
                0
            );
            assert_eq!(
                libc::mount(
                    d.as_ptr(),
                    d.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null()
                ),
                0
            );
            assert_eq!(
                libc::mount(
                    std::ptr::null(),
                    d.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
                    std::ptr::null()
                ),
                0
            );
        }
        f()
    })
    .join()
    .unwrap()
}

#[test]
fn read_only_state_dir_is_refused_and_changes_nothing() {
    if !is_root() {
        return skip_or_fail("needs root (mount namespace)");
    }
    let env = TestEnv::new("rofs");
    let set = defs(&["name=io,cpus=0,policy=io"]);
    let backend = match have_v1() {
        true => Backend::CpusetV1,
        false => Backend::Affinity,
    };
    let before = env.snapshot();
    // No state directory yet, and it cannot be made.
    let (st, s2) = (env.state.clone(), set.clone());
    let e = with_read_only(&env.base, move || {
        create(&st, &s2, Some(backend)).map(|_| ())
    })
    .unwrap_err();
    assert!(matches!(e, DefError::Permission { .. }), "{e}");
    assert_eq!(env.snapshot(), before);
    // Pools exist; the directory turns read-only: destroy and publishing are refused (the
    // cgroups stay too), reading still works.
    create(&env.state, &set, Some(backend)).unwrap();
    let mid = env.snapshot();
    let st = env.state.clone();
    let (destroyed, published, opened) = with_read_only(&env.base, move || {
        (
            destroy(&st, false).map(|_| ()),
            lucid_pools::def::VmPublisher::new(&st).map(|_| ()),
            Placer::open(&st).map(|p| p.is_some()),
        )
    });
    let e = destroyed.unwrap_err();
    assert!(matches!(e, DefError::Permission { .. }), "{e}");
    let e = published.unwrap_err();
    assert!(matches!(e, DefError::Permission { .. }), "{e}");
    assert!(opened.unwrap());
    assert_eq!(env.snapshot(), mid);
    destroy(&env.state, false).unwrap();
    assert_eq!(env.snapshot(), before);
}

#[test]
fn stale_vm_files_are_ignored_and_cleaned() {
    let env = TestEnv::new("stale");
    let set = defs(&["name=io,cpus=0,policy=io"]);
    create(&env.state, &set, Some(Backend::Affinity)).unwrap();
    // A VM that crashed: its pid no longer runs.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id() as i32;
    child.wait().unwrap();
    let mut rec = VmRecord::for_self("dead");
    rec.pid = dead;
    env.state.write_vm(&rec).unwrap();
    // A pid reused by another program: same pid as us, other start time.
    let mut reused = VmRecord::for_self("reused");
    reused.start_time += 1;
    std::fs::write(
        env.state.vm_file(reused.pid),
        serde_json::to_string(&reused).unwrap(),
    )
    .unwrap();
    std::fs::write(env.state.vms_dir().join("garbage.json"), "{").unwrap();
    assert!(env.state.vms(false).is_empty());
    assert_eq!(std::fs::read_dir(env.state.vms_dir()).unwrap().count(), 3);
    assert!(env.state.vms(true).is_empty());
    assert_eq!(std::fs::read_dir(env.state.vms_dir()).unwrap().count(), 0);
    // A live VM is listed; a file caught mid-rewrite is skipped, not removed.
    let publ = lucid_pools::def::VmPublisher::new(&env.state).unwrap();
    let mut live = VmRecord::for_self("live");
    live.monitor = serde_json::json!({"window": 1});
    publ.publish(&live).unwrap();
    let vms = env.state.vms(true);
    assert_eq!(vms.len(), 1);
    assert_eq!(vms[0], live);
    live.monitor = serde_json::json!({"window": 2});
    publ.publish(&live).unwrap();
    assert_eq!(env.state.vms(true)[0].monitor["window"], 2);
    std::fs::write(publ.path(), "{\"pid\":").unwrap();
    assert!(env.state.vms(true).is_empty());
    assert!(publ.path().exists(), "a live VM's torn file is kept");
    publ.publish(&live).unwrap();
    assert!(matches!(
        destroy(&env.state, false),
        Err(DefError::InUse { .. })
    ));
    // At exit the file is emptied (no unlink: the VM may be confined by seccomp)...
    let path = publ.path().to_path_buf();
    drop(publ);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
    // ...and removed by the next reader once the pid is gone (here: a dead pid's name).
    let dead_path = env.state.vm_file(dead);
    std::fs::rename(&path, &dead_path).unwrap();
    assert!(env.state.vms(true).is_empty());
    assert!(!dead_path.exists());
    // Only stale files left: destroy goes ahead and removes them.
    env.state.write_vm(&rec).unwrap();
    destroy(&env.state, false).unwrap();
    assert!(!env.state.dir.exists());
}
