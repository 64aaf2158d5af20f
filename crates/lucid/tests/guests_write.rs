//! `lucid guests --write DIR`: the built-in guests as ELF files that boot by path as they boot
//! by name.

mod common;

use std::time::Duration;

use common::{tmp, Outcome};

const LIMIT: Duration = Duration::from_secs(30);

fn run(args: &[&str]) -> Outcome {
    common::lucid_plain(args, LIMIT)
}

#[test]
fn written_guests_boot_by_path_as_by_name() {
    let dir = tmp("guests-write");
    let _ = std::fs::remove_dir_all(&dir);
    let o = run(&["guests", "--write", dir.to_str().unwrap()]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    assert_eq!(
        o.stdout.lines().count(),
        lucid_guests::NAMES.len(),
        "{}",
        o.stdout
    );
    for name in lucid_guests::NAMES {
        let path = dir.join(format!("{name}.elf"));
        assert!(o.stdout.contains(path.to_str().unwrap()), "{}", o.stdout);
        let bytes = std::fs::read(&path).expect("written");
        assert_eq!(Some(&bytes[..]), lucid_guests::get(name), "{name}");
    }
    // hello exits with its code, triplefault with Lucid's triple-fault status.
    for (name, args, want) in [
        ("hello", &["--cmdline", "code=5"][..], 11),
        ("triplefault", &[], 2),
    ] {
        let path = dir.join(format!("{name}.elf"));
        let by_name = run(&[&["run", "--guest", name][..], args].concat());
        let by_path = run(&[&["run", "--kernel", path.to_str().unwrap()][..], args].concat());
        assert_eq!(by_name.status, Some(want), "{name}: {}", by_name.stderr);
        assert_eq!(by_path.status, Some(want), "{name}: {}", by_path.stderr);
        assert_eq!(by_path.stdout, by_name.stdout, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unwritable_directory_is_a_failure() {
    let file = tmp("guests-write-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let o = run(&["guests", "--write", file.join("sub").to_str().unwrap()]);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE), "{}", o.stderr);
    assert!(
        o.stderr.contains("cannot write the guests to"),
        "{}",
        o.stderr
    );
    let _ = std::fs::remove_file(file);
}
