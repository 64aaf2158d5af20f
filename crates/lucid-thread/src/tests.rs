use super::*;
use std::sync::Mutex;

fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

#[test]
fn a_thread_gets_its_name_and_registers_with_its_role_until_it_ends() {
    let spawner = Spawner::new(None, ThreadRegistry::new());
    let threads = spawner.threads().clone();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let t = spawner
        .spawn(
            ThreadSpec::new("lucid-test-io", ThreadRole::Backend, Role::Backend),
            move |confined| {
                confined.unwrap();
                go_rx.recv().unwrap();
                (std::thread::current().name().map(String::from), gettid())
            },
        )
        .unwrap();
    // Registered before spawn returned.
    let list = threads.list();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].name, "lucid-test-io");
    assert_eq!(list[0].role, ThreadRole::Backend);
    go_tx.send(()).unwrap();
    let (name, tid) = t.join().unwrap();
    assert_eq!(name.as_deref(), Some("lucid-test-io"));
    assert_eq!(list[0].tid, tid);
    assert!(threads.list().is_empty());
}

#[test]
fn the_placer_runs_on_the_new_thread_before_spawn_returns_and_before_confinement() {
    let spawner = Spawner::new(None, ThreadRegistry::new());
    let steps = Arc::new(Mutex::new(Vec::new()));
    let s = steps.clone();
    spawner.set_placer(Some(Arc::new(move |t: &ThreadInfo| {
        s.lock().unwrap().push(format!(
            "place {} {:?} {}",
            t.name,
            t.role,
            t.tid == gettid()
        ));
    })));
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let s = steps.clone();
    let s2 = steps.clone();
    let t = spawner
        .clone()
        .spawn(
            ThreadSpec::new("lucid-vcpu3", ThreadRole::Vcpu(3), Role::Vcpu).before_confine(
                move || {
                    go_rx.recv().unwrap();
                    s.lock().unwrap().push("before".into())
                },
            ),
            move |confined| {
                s2.lock()
                    .unwrap()
                    .push(format!("body {}", confined.is_ok()));
            },
        )
        .unwrap();
    assert_eq!(
        *steps.lock().unwrap(),
        ["place lucid-vcpu3 Vcpu(3) true"],
        "placed before spawn returned"
    );
    go_tx.send(()).unwrap();
    t.join().unwrap();
    assert_eq!(
        *steps.lock().unwrap(),
        ["place lucid-vcpu3 Vcpu(3) true", "before", "body true"]
    );

    // Without a placer, threads stay where they start.
    spawner.set_placer(None);
    spawner
        .spawn(
            ThreadSpec::new("lucid-test", ThreadRole::Other, Role::Main),
            |_| (),
        )
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(steps.lock().unwrap().len(), 3);
}

/// Makes `seccomp(2)` fail with EPERM on the calling thread and every thread it starts.
fn refuse_seccomp_here() {
    let filter = seccompiler::SeccompFilter::new(
        [(libc::SYS_seccomp, vec![])].into_iter().collect(),
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(libc::EPERM as u32),
        seccompiler::TargetArch::x86_64,
    )
    .unwrap();
    let prog: seccompiler::BpfProgram = filter.try_into().unwrap();
    seccompiler::apply_filter(&prog).unwrap();
}

#[test]
fn a_thread_that_cannot_confine_itself_is_told_so() {
    let stats = lucid_stats::StatsRegistry::new();
    let seccomp = Seccomp::prepare(&stats).unwrap();
    let spawner = Spawner::new(Some(seccomp), stats.threads().clone());
    // From a scratch thread, so that only it and the thread it starts lose seccomp(2).
    let outcome = std::thread::spawn(move || {
        refuse_seccomp_here();
        spawner
            .spawn(
                ThreadSpec::new("lucid-test-io", ThreadRole::Backend, Role::Backend),
                |confined| confined.map_err(|e| e.to_string()),
            )
            .unwrap()
            .join()
            .unwrap()
    })
    .join()
    .unwrap();
    let e = outcome.unwrap_err();
    assert!(
        e.starts_with("thread lucid-test-io cannot confine itself:"),
        "{e}"
    );
    assert_eq!(stats.snapshot()["seccomp.confined.backend"], 0);
}

#[test]
fn a_background_thread_stops_when_asked_and_when_dropped() {
    use std::sync::atomic::AtomicU32;
    let spawner = Spawner::new(None, ThreadRegistry::new());
    let spec = || ThreadSpec::new("lucid-test-bg", ThreadRole::Other, Role::Pager);
    let ran = Arc::new(AtomicU32::new(0));
    let r = ran.clone();
    let mut t = spawner
        .spawn_background(spec(), move |confined, stop| {
            confined.unwrap();
            while !stop.load(Ordering::Acquire) {
                std::thread::park_timeout(std::time::Duration::from_secs(60));
            }
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert_eq!(spawner.threads().list()[0].name, "lucid-test-bg");
    t.stop();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    t.stop();
    let r = ran.clone();
    drop(
        spawner
            .spawn_background(spec(), move |_, stop| {
                while !stop.load(Ordering::Acquire) {
                    std::thread::park_timeout(std::time::Duration::from_secs(60));
                }
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap(),
    );
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert!(spawner.threads().list().is_empty());
}
