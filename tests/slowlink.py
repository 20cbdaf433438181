"""A slow, lossy link for one test host (tests/hosts.py), in user space: what ``tc qdisc add dev eth0 root netem
delay 1s loss 20%`` inside the host would do, where the kernel has no sch_netem (this machine's has none, and no
modprobe). The host's veth is replaced by a TAP device carrying its address and MAC; a second TAP sits on the
cluster's bridge; a thread of the test process copies frames between the two, delaying each frame the host sends by
``delay_s`` and dropping it with probability ``loss`` (egress, as netem on the host's eth0), and passing the frames
it receives at once. TAP devices advertise no offloads, so the kernel hands over whole, checksummed frames. Only
frames are touched: TCP sees the delay and the losses as on a real link (retransmissions, a longer round trip).
Set up before the host's processes start (connections over the old veth would break); undone by ``close``.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import threading
import time

from tests import hosts

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def _write(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:  # the device is down (being closed): the frame is lost, as on a cable
        pass


class SlowLink:
    def __init__(self, cluster: hosts.Cluster, host: hosts.Host, delay_s: float, loss: float, seed: int = 0):
        index = cluster.hosts.index(host) + 1
        veth = f"{hosts.PREFIX}{cluster.id}{index}"
        inner, outer = f"{veth}s", f"{veth}b"  # eng-t-<pid><letter><index><s|b>: tests/hosts.py cleans them up
        inside = ["ip", "netns", "exec", host.ns]
        mac = subprocess.run([*inside, "cat", "/sys/class/net/eth0/address"], capture_output=True, text=True)
        mac = mac.stdout.strip()
        self.inner_fd, self.outer_fd = _tap(inner), _tap(outer)
        _run("ip", "link", "set", veth, "down")
        _run(*inside, "ip", "link", "set", "eth0", "down")
        _run(*inside, "ip", "addr", "flush", "dev", "eth0")
        _run("ip", "link", "set", inner, "netns", host.ns)
        _run(*inside, "ip", "link", "set", inner, "address", mac)
        _run(*inside, "ip", "addr", "add", f"{host.addr}/24", "dev", inner)
        _run(*inside, "ip", "link", "set", inner, "up")
        _run("ip", "link", "set", outer, "master", f"{hosts.PREFIX}{cluster.id}", "up")
        self.delay, self.loss, self.random = delay_s, loss, random.Random(seed)
        self.sent = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, name="slow-link", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        queue: list[tuple[float, int, bytes]] = []
        count = 0
        while not self._stop.is_set():
            wait = min(0.2, max(0.0, queue[0][0] - time.monotonic())) if queue else 0.2
            ready, _, _ = select.select([self.inner_fd, self.outer_fd], [], [], wait)
            now = time.monotonic()
            if self.inner_fd in ready:  # the slow host sends: delayed, or lost
                frame = os.read(self.inner_fd, 65536)
                if self.random.random() < self.loss:
                    self.dropped += 1
                else:
                    heapq.heappush(queue, (now + self.delay, count, frame))
                    count += 1
            if self.outer_fd in ready:  # the slow host receives: at once
                _write(self.inner_fd, os.read(self.outer_fd, 65536))
            while queue and queue[0][0] <= now:
                _write(self.outer_fd, heapq.heappop(queue)[2])
                self.sent += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        os.close(self.inner_fd)  # a TAP that is not persistent goes with its last file descriptor
        os.close(self.outer_fd)
