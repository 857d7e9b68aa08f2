#!/usr/bin/env python3
"""Regenerates the seed corpus of the NBD fuzz targets (tests/blockdev/fuzz/*.cc).

request/*:   byte 0 = negotiated features, bytes 1-8 = export size, then a request stream.
handshake/*: byte 0 = export capabilities, then what a client sends after the greeting.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
IHAVEOPT = 0x49484156454F5054
REQ_MAGIC = 0x25609513
ALL = 0x3F  # structured + flush + fua + trim + zeroes + multi-conn


def opt(option, data=b""):
    return struct.pack(">QII", IHAVEOPT, option, len(data)) + data


def go_data(name=b"", infos=()):
    return struct.pack(">I", len(name)) + name + struct.pack(">H", len(infos)) + b"".join(
        struct.pack(">H", i) for i in infos)


def req(type_, offset, length, flags=0, handle=1, payload=b""):
    return struct.pack(">IHHQQI", REQ_MAGIC, flags, type_, handle, offset, length) + payload


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


FLAGS = struct.pack(">I", 3)  # fixed newstyle + no zeroes
handshakes = {
    "go_default": FLAGS + opt(7, go_data(b"", (3, 1, 2))),
    "structured_then_go": FLAGS + opt(8) + opt(7, go_data(b"disk", (3,))),
    "info_then_go": FLAGS + opt(6, go_data(b"disk", (0, 3))) + opt(7, go_data(b"", ())),
    "export_name_zeroes": struct.pack(">I", 1) + opt(1, b"disk"),
    "export_name_plain_newstyle": struct.pack(">I", 0) + opt(1),
    "list_then_abort": FLAGS + opt(3) + opt(2),
    "unknown_options": FLAGS + opt(99, b"abc") + opt(5) + opt(10, b"\0" * 8) + opt(7, go_data()),
    "oversized_option": FLAGS + opt(7, b"\xee" * 9000) + opt(7, go_data()),
    "bad_go_lengths": FLAGS + opt(7, struct.pack(">I", 0xFFFFFFF0) + b"\0\0") + opt(6, b"\0" * 3),
    "unknown_export": FLAGS + opt(7, go_data(b"nope")) + opt(1, b"nope"),
}
for name, data in handshakes.items():
    write(os.path.join(HERE, "handshake", name), bytes([0x7E]) + data)

size = struct.pack(">Q", 64 << 20)
requests = {
    "read_write_flush": req(1, 4096, 512, payload=b"\xab" * 512) + req(0, 4096, 512, 4, 2) +
                        req(3, 0, 0, 0, 3) + req(2, 0, 0, 0, 4),
    "trim_zero_fua": req(4, 0, 1 << 20, 1) + req(6, 8192, 4096, 2) + req(6, 0, 512, 0x10),
    "out_of_range": req(0, 64 << 20, 512) + req(1, 0xFFFFFFFFFFFFFE00, 1024, payload=b"\0" * 1024),
    "unknown_commands": req(5, 0, 512) + req(7, 0, 512) + req(0xFFFF, 0, 0, 0xFFFF),
    "oversized": req(0, 0, 0xFFFFFE00) + req(1, 0, (32 << 20) + 512),
    "bad_magic": b"\x25\x60\x95\x14" + b"\0" * 24,
    "misaligned": req(0, 1, 512) + req(1, 0, 100, payload=b"\1" * 100),
}
for name, data in requests.items():
    write(os.path.join(HERE, "request", name), bytes([ALL]) + size + data)
write(os.path.join(HERE, "request", "simple_replies_df"),
      bytes([0x3E]) + size + req(0, 0, 4096, 4) + req(0, 0, 4096, 1))
