#!/usr/bin/env python3
"""Outbound capture through a local route: what it would take (issue 42).

Two network namespaces joined by a veth (MTU 1500): a "pod" (10.77.0.1) and a
"remote" (10.77.0.2). In the pod, a transparent listener on 0.0.0.0:7000
stands in for ztunnel's 15001 (ztunnel's in-pod listeners are transparent).
The script adds to the pod the policy rule and route a local-route capture
would use:

    ip rule add not fwmark 0x539/0xfff ipproto tcp lookup 100
    ip route add local default dev lo src 10.77.0.1 table 100

and prints what happens to: an app's new connection to the remote address
(where it lands, its source address, its MSS, its throughput against the
same flow over the veth), a connection made before the rule, and an inbound
connection (bare; with accept_local; with the inbound SYN marked, the mark
taken by the request socket via tcp_fwmark_accept, and a rule sending that
mark to the main table).

Run as root on a scratch machine: `python3 docs/experiments/local_route.py`.
It removes its namespaces when it ends, fails, or gets SIGINT or SIGTERM.
Not part of the test suite.
"""
import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

LIBC = ctypes.CDLL(None, use_errno=True)
POD, REMOTE = "slx-lr-pod", "slx-lr-remote"
IP_TRANSPARENT = 19


def sh(cmd, check=True):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd}: {r.stderr.strip()}")
    return r


def enter(ns):
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if LIBC.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


def in_ns(ns, f):
    """Runs f() on a thread in netns `ns`; its result or its exception."""
    out = {}

    def run():
        enter(ns)
        try:
            out["ok"] = f()
        except Exception as e:  # reported, not raised: the next step runs
            out["err"] = repr(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=20)
    return out.get("ok", out.get("err", "no answer"))


def listen(ns, addr, transparent, stop):
    ready = threading.Event()

    def serve():
        enter(ns)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if transparent:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        s.bind((addr, 7000))
        s.listen(16)
        s.settimeout(0.2)
        ready.set()
        while not stop.is_set():
            try:
                c, _ = s.accept()
            except socket.timeout:
                continue
            threading.Thread(target=drain, args=(c,), daemon=True).start()
        s.close()

    threading.Thread(target=serve, daemon=True).start()
    if not ready.wait(5):
        raise RuntimeError(f"no listener in {ns}")


def drain(c):
    c.settimeout(5)
    try:
        while c.recv(1 << 20):
            pass
    except OSError:
        pass
    c.close()


def bulk(dst, secs=1.0):
    c = socket.create_connection((dst, 7000), timeout=2)
    info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    mss = struct.unpack("I", info[16:20])[0]  # tcpi_snd_mss
    buf, sent, t0 = b"x" * (1 << 20), 0, time.time()
    while time.time() - t0 < secs:
        sent += c.send(buf)
    gbit = sent * 8 / (time.time() - t0) / 1e9
    src = c.getsockname()[0]
    c.close()
    return f"source {src}, MSS {mss}, {gbit:.1f} Gbit/s"


def inbound():
    c = socket.create_connection(("10.77.0.1", 7000), timeout=2)
    c.close()
    return "connected"


def main():
    stop = threading.Event()
    try:
        for cmd in [
            f"ip netns add {POD}",
            f"ip netns add {REMOTE}",
            f"ip link add p0 netns {POD} type veth peer name r0 netns {REMOTE}",
            f"ip -n {POD} addr add 10.77.0.1/24 dev p0",
            f"ip -n {REMOTE} addr add 10.77.0.2/24 dev r0",
            f"ip -n {POD} link set p0 up",
            f"ip -n {REMOTE} link set r0 up",
            f"ip -n {POD} link set lo up",
        ]:
            sh(cmd)
        listen(REMOTE, "10.77.0.2", False, stop)
        listen(POD, "0.0.0.0", True, stop)
        print("app to the remote, over the veth:", in_ns(POD, lambda: bulk("10.77.0.2")))
        before = in_ns(POD, lambda: socket.create_connection(("10.77.0.2", 7000), timeout=2))
        sh(f"ip -n {POD} rule add not fwmark 0x539/0xfff ipproto tcp lookup 100 pref 100")
        sh(f"ip -n {POD} route add local default dev lo src 10.77.0.1 table 100")
        print("app to the remote, local route (lands on the pod's listener):",
              in_ns(POD, lambda: bulk("10.77.0.2")))

        def later_send():
            before.settimeout(2)
            before.send(b"x" * 1000)
            time.sleep(0.3)
            before.send(b"x" * 1000)
            return "still open"

        print("a connection from before the rule:",
              in_ns(POD, later_send) if isinstance(before, socket.socket) else before)
        print("inbound, bare:", in_ns(REMOTE, inbound))
        sh(f"ip netns exec {POD} sysctl -qw net.ipv4.conf.p0.accept_local=1")
        print("inbound, accept_local on p0:", in_ns(REMOTE, inbound))
        sh(f"ip netns exec {POD} sysctl -qw net.ipv4.tcp_fwmark_accept=1")
        sh(f"ip netns exec {POD} iptables -t mangle -A PREROUTING -i p0 -p tcp --syn "
           "-j MARK --set-mark 0x222")
        sh(f"ip -n {POD} rule add fwmark 0x222/0xfff lookup main pref 90")
        print("inbound, SYN marked, tcp_fwmark_accept, mark to main:", in_ns(REMOTE, inbound))
    finally:
        stop.set()
        time.sleep(0.3)
        for ns in (POD, REMOTE):
            try:
                sh(f"ip netns del {ns}", check=False)
            except subprocess.TimeoutExpired:
                print(f"removing {ns} timed out: `ip netns del {ns}` by hand", file=sys.stderr)


if __name__ == "__main__":
    # SIGTERM unwinds like SIGINT, through main's cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    main()
