#!/usr/bin/env python3
"""Writes the seeds of the vsock_packets fuzz target: tx packets (a 44-byte header, then `len`
payload bytes) as lucid_virtio::vsock::fuzz_packets reads them. Run from fuzz/:
python3 seeds/vsock_seeds.py"""
import os
import struct

REQUEST, RESPONSE, RST, SHUTDOWN, RW, CREDIT_UPDATE, CREDIT_REQUEST = range(1, 8)


def pkt(op, src_port=1000, dst_port=5000, payload=b"", length=None, type_=1, flags=0,
        buf_alloc=65536, fwd_cnt=0, src_cid=3, dst_cid=2):
    n = len(payload) if length is None else length
    return struct.pack("<QQIIIHHIII", src_cid, dst_cid, src_port, dst_port, n, type_, op, flags,
                       buf_alloc, fwd_cnt) + payload


def save(name, packets):
    os.makedirs("seeds/vsock_packets", exist_ok=True)
    with open(f"seeds/vsock_packets/{name}", "wb") as f:
        f.write(b"".join(packets))


save("connect-rw-shutdown", [pkt(REQUEST), pkt(RW, payload=b"hello"), pkt(CREDIT_REQUEST),
                              pkt(CREDIT_UPDATE, fwd_cnt=4), pkt(SHUTDOWN, flags=3)])
save("bad-headers", [pkt(RW, payload=b"x"), pkt(99), pkt(REQUEST, type_=2),
                     pkt(REQUEST, src_cid=7), pkt(REQUEST, dst_cid=3), pkt(RESPONSE),
                     pkt(RW, length=70000)])
save("credit-overflow", [pkt(REQUEST, src_port=7)] +
     [pkt(RW, src_port=7, payload=bytes(4000)) for _ in range(8)])
save("many-connections", [pkt(REQUEST, src_port=2000 + i) for i in range(70)] +
     [pkt(RST, src_port=2000 + i) for i in range(0, 70, 2)])
save("host-hangup", [pkt(REQUEST, src_port=9), pkt(RW, src_port=9, payload=b"abc", flags=0x100),
                     pkt(RW, src_port=9, payload=b"def"), pkt(SHUTDOWN, src_port=9, flags=1),
                     pkt(SHUTDOWN, src_port=9, flags=2), pkt(RW, src_port=9, payload=b"late")])
