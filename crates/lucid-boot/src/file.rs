//! Opening the kernel and initrd files the user names: only regular files, with the size checked
//! before a byte is read, so that `/dev/zero`, a FIFO or a huge sparse file gives an error
//! instead of a hang or an exhausted host.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::BootError;

/// The largest kernel file Lucid reads (a vmlinux with full debug information is 0.3-1 GiB;
/// only its loadable segments reach guest memory, and those must fit in guest RAM).
pub const MAX_KERNEL_FILE: u64 = 2 << 30;

/// What a path names when it is not a regular file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Directory,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
    Other,
}

impl FileKind {
    fn of(t: std::fs::FileType) -> Option<FileKind> {
        Some(if t.is_file() {
            return None;
        } else if t.is_dir() {
            FileKind::Directory
        } else if t.is_char_device() {
            FileKind::CharDevice
        } else if t.is_block_device() {
            FileKind::BlockDevice
        } else if t.is_fifo() {
            FileKind::Fifo
        } else if t.is_socket() {
            FileKind::Socket
        } else {
            FileKind::Other
        })
    }
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileKind::Directory => "a directory",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Fifo => "a FIFO",
            FileKind::Socket => "a socket",
            FileKind::Other => "not a regular file",
        })
    }
}

/// Opens `path` for reading if it is a regular file of at most `max` bytes; returns the file and
/// its size. Opened with `O_NONBLOCK` so that a FIFO without a writer cannot block the open; the
/// type is checked on the opened descriptor, so nothing can be swapped in between.
pub(crate) fn open_regular(
    path: &Path,
    what: &'static str,
    max: u64,
) -> Result<(File, u64), BootError> {
    let io = |source| BootError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if let Some(kind) = FileKind::of(meta.file_type()) {
        return Err(BootError::NotARegularFile {
            path: path.to_path_buf(),
            what,
            kind,
        });
    }
    if meta.len() > max {
        return Err(BootError::FileTooLarge {
            path: path.to_path_buf(),
            what,
            size: meta.len(),
            max,
        });
    }
    Ok((file, meta.len()))
}

/// Reads a whole regular file of at most `max` bytes (see [`open_regular`]). A file that grows
/// while it is read is cut at `max + 1` bytes and refused.
pub(crate) fn read_regular(
    path: &Path,
    what: &'static str,
    max: u64,
) -> Result<Vec<u8>, BootError> {
    let (file, size) = open_regular(path, what, max)?;
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| BootError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    if bytes.len() as u64 > max {
        return Err(BootError::FileTooLarge {
            path: path.to_path_buf(),
            what,
            size: bytes.len() as u64,
            max,
        });
    }
    Ok(bytes)
}
