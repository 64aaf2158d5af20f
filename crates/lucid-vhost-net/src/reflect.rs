//! The echo mode's reflector, without queues or memory: what a transmitted buffer becomes on
//! the receive side, and the bounded backlog of frames waiting for receive buffers.

use std::collections::VecDeque;

/// `struct virtio_net_hdr_v1`: what precedes every frame on both queues with
/// `VIRTIO_F_VERSION_1` (flags, gso_type, hdr_len, gso_size, csum_start, csum_offset,
/// num_buffers).
pub const NET_HDR_LEN: usize = 12;
/// An Ethernet header: destination MAC, source MAC, ethertype.
pub const ETH_HDR_LEN: usize = 14;
/// The largest frame reflected (no GSO is offered, so this only bounds a hostile chain).
pub const MAX_FRAME: usize = 65_535;
/// Frames held while the receive queue has no buffers; more are dropped.
pub const BACKLOG: usize = 256;

/// Why a transmitted buffer is not reflected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{0} bytes: shorter than the virtio-net header and an Ethernet header")]
    Runt(usize),
    #[error("{0} bytes: longer than the virtio-net header and {MAX_FRAME} bytes")]
    TooBig(usize),
}

/// Turns `buf`, a transmitted buffer (virtio-net header, then the frame), into the buffer to
/// receive, in place: a header with no offload flags and `num_buffers` 1 (what a device without
/// `VIRTIO_NET_F_MRG_RXBUF` writes), then the frame with its source and destination MAC
/// addresses swapped.
pub fn reflect(buf: &mut [u8]) -> Result<(), Refused> {
    if buf.len() < NET_HDR_LEN + ETH_HDR_LEN {
        return Err(Refused::Runt(buf.len()));
    }
    if buf.len() > NET_HDR_LEN + MAX_FRAME {
        return Err(Refused::TooBig(buf.len()));
    }
    let (hdr, frame) = buf.split_at_mut(NET_HDR_LEN);
    hdr.fill(0);
    hdr[10..12].copy_from_slice(&1u16.to_le_bytes());
    let (dst, rest) = frame.split_at_mut(6);
    dst.swap_with_slice(&mut rest[..6]);
    Ok(())
}

/// Reflected buffers waiting for the guest's receive buffers, oldest first.
#[derive(Default)]
pub struct Backlog(VecDeque<Vec<u8>>);

impl Backlog {
    /// Queues `buf`; gives it back when [`BACKLOG`] buffers already wait.
    pub fn push(&mut self, buf: Vec<u8>) -> Result<(), Vec<u8>> {
        if self.0.len() >= BACKLOG {
            return Err(buf);
        }
        self.0.push_back(buf);
        Ok(())
    }

    pub fn front(&self) -> Option<&Vec<u8>> {
        self.0.front()
    }

    pub fn pop(&mut self) -> Option<Vec<u8>> {
        self.0.pop_front()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

/// The device's configuration space (`struct virtio_net_config`): `mac`, `status`
/// (VIRTIO_NET_S_LINK_UP, read only with `VIRTIO_NET_F_STATUS`, which is not offered) and
/// `max_virtqueue_pairs` 1; `size` bytes from `offset`, zero past its end.
pub fn config_bytes(mac: [u8; 6], offset: u32, size: u32) -> Vec<u8> {
    let mut cfg = [0u8; 10];
    cfg[..6].copy_from_slice(&mac);
    cfg[6..8].copy_from_slice(&1u16.to_le_bytes());
    cfg[8..10].copy_from_slice(&1u16.to_le_bytes());
    // The protocol caps a config message at 256 bytes; more is never asked honestly.
    let size = size.min(256);
    (0..size)
        .map(|i| {
            offset
                .checked_add(i)
                .and_then(|at| cfg.get(at as usize).copied())
                .unwrap_or(0)
        })
        .collect()
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx_buf(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
        let mut b = vec![0xaa; NET_HDR_LEN];
        b.extend_from_slice(&dst);
        b.extend_from_slice(&src);
        b.extend_from_slice(&[0x88, 0xb5]);
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn macs_are_swapped_and_the_rest_kept() {
        let a = [2, 0, 0, 0, 0, 1];
        let b = [2, 0, 0, 0, 0, 2];
        let payload: Vec<u8> = (0..100u8).collect();
        let mut buf = tx_buf(a, b, &payload);
        reflect(&mut buf).unwrap();
        let want_hdr = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0];
        assert_eq!(&buf[..NET_HDR_LEN], &want_hdr);
        assert_eq!(buf[NET_HDR_LEN..NET_HDR_LEN + 6], b);
        assert_eq!(buf[NET_HDR_LEN + 6..NET_HDR_LEN + 12], a);
        assert_eq!(buf[NET_HDR_LEN + 12..NET_HDR_LEN + 14], [0x88, 0xb5]);
        assert_eq!(&buf[NET_HDR_LEN + 14..], &payload[..]);
        // Reflecting twice gives the transmitted frame back.
        reflect(&mut buf).unwrap();
        assert_eq!(buf[NET_HDR_LEN..], tx_buf(a, b, &payload)[NET_HDR_LEN..]);
    }

    #[test]
    fn runts_and_giants_are_refused() {
        for n in [0, 1, NET_HDR_LEN, NET_HDR_LEN + ETH_HDR_LEN - 1] {
            assert_eq!(reflect(&mut vec![0; n]), Err(Refused::Runt(n)));
        }
        let mut smallest = vec![0; NET_HDR_LEN + ETH_HDR_LEN];
        assert_eq!(reflect(&mut smallest), Ok(()));
        let mut largest = vec![0; NET_HDR_LEN + MAX_FRAME];
        assert_eq!(reflect(&mut largest), Ok(()));
        let n = NET_HDR_LEN + MAX_FRAME + 1;
        assert_eq!(reflect(&mut vec![0; n]), Err(Refused::TooBig(n)));
    }

    #[test]
    fn the_backlog_is_bounded_and_in_order() {
        let mut b = Backlog::default();
        for i in 0..BACKLOG {
            b.push(vec![i as u8]).unwrap();
        }
        assert_eq!(b.push(vec![0xff]), Err(vec![0xff]));
        assert_eq!(b.len(), BACKLOG);
        assert_eq!(b.front(), Some(&vec![0]));
        assert_eq!(b.pop(), Some(vec![0]));
        assert_eq!(b.pop(), Some(vec![1]));
        b.push(vec![0xfe]).unwrap();
        b.clear();
        assert!(b.is_empty());
    }

    #[test]
    fn config_space_has_the_mac_and_one_queue_pair() {
        let mac = [0x52, 0x54, 0, 0x12, 0x34, 0x57];
        assert_eq!(config_bytes(mac, 0, 6), mac);
        assert_eq!(config_bytes(mac, 4, 8), [0x34, 0x57, 1, 0, 1, 0, 0, 0]);
        assert_eq!(config_bytes(mac, u32::MAX, 4), [0; 4]);
        assert_eq!(config_bytes(mac, 0, u32::MAX).len(), 256);
    }

    #[test]
    fn macs_parse() {
        assert_eq!(
            parse_mac("52:54:00:ab:CD:ef"),
            Some([0x52, 0x54, 0, 0xab, 0xcd, 0xef])
        );
        for bad in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:ef:01",
            "5:54:00:ab:cd:ef",
            "zz:54:00:ab:cd:ef",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }
}
