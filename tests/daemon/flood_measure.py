#!/usr/bin/env python3
"""Measures what a flood of idle TCP connections costs a farmemd (docs/operations.md,
"Connection floods"). Not a test: it prints figures.

  tests/daemon/flood_measure.py --farmemd build/bin/farmemd --farmemctl build/bin/farmemctl \
      --sockets 10000 -- --max-pending-handshakes 10000 --handshake-timeout-ms 60000

Starts the daemon (capacity 64M, 1M slabs, a secret, --no-mlock, plus the options after --),
opens N connections that send nothing (or, with --authenticated N, N connections that
authenticate and send one STAT), then reports the daemon's threads and RSS, how long
`farmemctl stat` takes meanwhile, the RSS after the sockets are closed, and its log line count.
"""
import argparse
import hashlib
import hmac
import os
import struct
import resource
import socket
import subprocess
import sys
import tempfile
import time


def status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split()[1]
    return "?"


MAGIC = 0x4D454D46


def frame(opcode, body, request_id=1):
    return struct.pack("<IBBHQIHH", MAGIC, 1, opcode, 0, request_id, len(body), 0, 0) + body


def recv_frame(s):
    hdr = b""
    while len(hdr) < 24:
        chunk = s.recv(24 - len(hdr))
        if not chunk:
            raise ConnectionError("closed")
        hdr += chunk
    body_len, status = struct.unpack_from("<IH", hdr, 16)
    body = b""
    while len(body) < body_len:
        body += s.recv(body_len - len(body))
    return status, body


def authenticated(port, secret):
    """One connection through HELLO and AUTH (docs/wire-protocol.md), then one STAT."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    client_id, client_nonce, name = os.urandom(16), os.urandom(32), b"flood"
    s.sendall(frame(1, struct.pack("<BBH", 1, 1, len(name)) + client_id + client_nonce + name))
    status, body = recv_frame(s)
    assert status == 0, body
    server_nonce = body[16:48]
    proof = hmac.new(secret, b"farmem-auth-v1 client" + server_nonce + client_nonce + client_id,
                     hashlib.sha256).digest()
    s.sendall(frame(2, proof, 2))
    status, body = recv_frame(s)
    assert status == 0, body
    s.sendall(frame(3, b"", 3))
    status, _ = recv_frame(s)
    assert status == 0
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--farmemd", required=True)
    ap.add_argument("--farmemctl", required=True)
    ap.add_argument("--sockets", type=int, default=10000)
    ap.add_argument("--authenticated", type=int, default=0,
                    help="instead of idle sockets, this many authenticated connections")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = tempfile.mkdtemp(prefix="farmem-flood-")
    secret = os.path.join(work, "secret")
    secret_bytes = b"farmem-flood-measure-secret"
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(secret_bytes)
    port_file = os.path.join(work, "port")
    log = open(os.path.join(work, "farmemd.log"), "w")
    d = subprocess.Popen([a.farmemd, "--listen", "127.0.0.1:0", "--port-file", port_file,
                          "--capacity", "64M", "--slab-size", "1M", "--no-mlock",
                          "--secret-file", secret, "--log-level", "warn"] + a.extra,
                         stdout=log, stderr=log)
    for _ in range(500):
        if os.path.exists(port_file):
            break
        time.sleep(0.01)
    port = int(open(port_file).read())
    rss0 = status(d.pid, "VmRSS")
    socks = []
    t0 = time.monotonic()
    count = a.authenticated or a.sockets
    for _ in range(count):
        if a.authenticated:
            socks.append(authenticated(port, secret_bytes))
        else:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    t_flood = time.monotonic() - t0
    time.sleep(1.0)  # let the daemon take them all in
    threads, rss = status(d.pid, "Threads"), status(d.pid, "VmRSS")
    t1 = time.monotonic()
    r = subprocess.run([a.farmemctl, "stat", "--peers", f"127.0.0.1:{port}",
                        "--secret-file", secret], capture_output=True, text=True, timeout=60)
    t_stat = time.monotonic() - t1
    stat_ok = r.returncode == 0 and "DOWN" not in r.stdout
    for s in socks:
        s.close()
    time.sleep(6.0)  # housekeeping runs every lease_ttl / 4 (2.5 s by default)
    rss_after = status(d.pid, "VmRSS")
    d.terminate()
    d.wait()
    log.close()
    lines = sum(1 for _ in open(os.path.join(work, "farmemd.log")))
    print(f"{'authenticated' if a.authenticated else 'idle'}_sockets={count} opened_in={t_flood:.1f}s threads={threads} "
          f"rss_idle={rss0}kB rss_flood={rss}kB rss_after_close={rss_after}kB "
          f"farmemctl_stat={'ok' if stat_ok else 'FAILED'} in {t_stat * 1000:.0f}ms "
          f"log_lines={lines}")


if __name__ == "__main__":
    sys.exit(main())
