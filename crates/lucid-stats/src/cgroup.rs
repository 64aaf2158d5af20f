//! Where the cgroup hierarchies are mounted, from `/proc/self/mountinfo`: the one mount
//! detection behind the pools' cpuset and VSWAPPER's memory controller.

use std::io;
use std::path::{Path, PathBuf};

/// One mounted cgroup hierarchy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    pub path: PathBuf,
    /// v1: the controllers bound to the hierarchy (its super options); `None` for cgroup2.
    pub v1_controllers: Option<Vec<String>>,
}

/// Where one controller can be used: the first v1 hierarchy it is bound to and the first
/// cgroup2 mount.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ControllerMounts {
    pub v1: Option<PathBuf>,
    pub v2: Option<PathBuf>,
    /// Whether the cgroup2 root lists the controller in `cgroup.controllers` (a controller
    /// bound to a v1 hierarchy is not offered on v2).
    pub v2_offers: bool,
}

pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// The cgroup mounts in [`MOUNTINFO`], in mount order.
pub fn mounts() -> io::Result<Vec<CgroupMount>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(MOUNTINFO)?))
}

/// Where `controller` (`cpuset`, `memory`, ...) is mounted on this host.
pub fn controller_mounts(controller: &str) -> io::Result<ControllerMounts> {
    let all = mounts()?;
    let v1 = all
        .iter()
        .find(|m| {
            m.v1_controllers
                .as_ref()
                .is_some_and(|c| c.iter().any(|c| c == controller))
        })
        .map(|m| m.path.clone());
    let v2 = all
        .into_iter()
        .find(|m| m.v1_controllers.is_none())
        .map(|m| m.path);
    let v2_offers = v2
        .as_deref()
        .is_some_and(|p| v2_controllers(p).iter().any(|c| c == controller));
    Ok(ControllerMounts { v1, v2, v2_offers })
}

/// The controllers a cgroup2 directory offers its children (`cgroup.controllers`; none when
/// it cannot be read).
pub fn v2_controllers(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("cgroup.controllers"))
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The cgroup mounts of a mountinfo text: `id parent major:minor root mountpoint options
/// [optional fields] - fstype source superoptions`.
pub fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let dash = f.iter().position(|&x| x == "-")?;
            let (mnt, fstype) = (f.get(4)?, *f.get(dash + 1)?);
            let v1_controllers = match fstype {
                "cgroup" => Some(f.get(dash + 3)?.split(',').map(str::to_string).collect()),
                "cgroup2" => None,
                _ => return None,
            };
            Some(CgroupMount {
                path: PathBuf::from(unescape(mnt)),
                v1_controllers,
            })
        })
        .collect()
}

/// The kernel escapes space, tab, newline and backslash in the paths of mountinfo and
/// /proc/swaps as octal (`\040`).
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_V1_AND_V2: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:22 / /sys/fs/cgroup rw shared:4 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:5 - cgroup2 cgroup2 rw,nsdelegate
30 25 0:27 / /sys/fs/cgroup/cpu\\040set rw,nosuid shared:9 - cgroup cgroup rw,cpuset
31 25 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:10 master:3 - cgroup cgroup rw,memory
32 22 0:29 / /mnt/other rw - cgroup2 cgroup2 rw
";

    #[test]
    fn finds_v1_hierarchies_with_their_controllers_and_cgroup2() {
        let m = parse_mountinfo(MOUNTINFO_V1_AND_V2);
        let paths: Vec<_> = m.iter().map(|m| m.path.to_str().unwrap()).collect();
        assert_eq!(
            paths,
            [
                "/sys/fs/cgroup/unified",
                "/sys/fs/cgroup/cpu set",
                "/sys/fs/cgroup/memory",
                "/mnt/other"
            ]
        );
        assert_eq!(m[0].v1_controllers, None);
        assert_eq!(
            m[1].v1_controllers,
            Some(vec!["rw".into(), "cpuset".into()])
        );
        // An optional field (`master:3`) before the dash does not shift the fields after it.
        assert_eq!(
            m[2].v1_controllers,
            Some(vec!["rw".into(), "memory".into()])
        );
        assert!(parse_mountinfo("garbage\n1 2 3\n").is_empty());
    }

    #[test]
    fn unescapes_mount_paths() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\04"), "/end\\04");
    }

    #[test]
    fn this_hosts_mounts_parse() {
        // Whatever this host mounts, every cgroup2 mount is a directory.
        for m in mounts().unwrap() {
            if m.v1_controllers.is_none() {
                assert!(m.path.is_dir(), "{m:?}");
            }
        }
    }
}
