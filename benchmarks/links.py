"""Real network links for benchmarks: hosts in their own network namespaces on one bridge, shaped by ``tc``.

A :class:`Lab` makes a switch namespace holding a Linux bridge and, per host, a
namespace joined to the bridge by a veth pair (``eth0`` inside the host, ``pN``
on the switch side). A host's link rate is a token bucket (``tc qdisc ... tbf``)
on both ends of its veth pair, so it applies to what the host sends and to what
it receives; a host without a rate is unshaped (veth speed: memory copies).
Addresses come from 198.18.0.0/15, the range RFC 2544 sets aside for network
benchmarks; the traffic never leaves the namespaces this lab made.

Everything is created under a unique name (``ckd<6 hex>-...``) and deleted by
:meth:`Lab.close` (a context manager; also on error or Ctrl-C), which first ends
the processes this lab started, by their own pids. Requires root, ``ip`` and
``tc``; :func:`available` says whether they work here.

    with Lab() as lab:
        srv = lab.add_host("srv")
        rep = lab.add_host("r0", rate_bit=1e9)
        proc = lab.popen(srv, ["rclone", "serve", "s3", ...])
        out = lab.run(rep, [sys.executable, "-c", "..."])
        lab.counters(srv)   # {"rx_bytes": ..., "tx_bytes": ...} of its eth0
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field

SUBNET = "198.18.{net}.{host}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when namespaces, veth and tbf work here; else why not (for a skip message)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip or tc not installed"
    if os.geteuid() != 0:
        return "not root"
    try:
        with Lab() as lab:
            h = lab.add_host("probe", rate_bit=1e9)
            lab.counters(h)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return f"network namespaces unavailable: {e}"
    return None


@dataclass
class Host:
    name: str         # role, e.g. "srv", "trainer", "r0"
    ns: str           # its network namespace
    ip: str           # its address on the bridge
    port: str         # its veth's switch-side end
    rate_bit: float | None = None


@dataclass
class Lab:
    """A bridge and hosts in network namespaces; see the module docstring."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _net: int = 0
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._net = int(self.tag[:2], 16)   # 198.18.<net>.0/24: labs running at once rarely share one
        self.switch = f"ckd{self.tag}-sw"

    def __enter__(self) -> "Lab":
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_host(self, name: str, *, rate_bit: float | None = None) -> Host:
        """A namespace on the bridge, its link shaped to ``rate_bit`` bits/s each way (None: unshaped)."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        idx = len(self.hosts) + 1
        if idx > 250:
            raise ValueError("a lab holds at most 250 hosts")
        h = Host(name, f"ckd{self.tag}-{name}", SUBNET.format(net=self._net, host=idx), f"p{idx}")
        self._add_ns(h.ns)
        _ip("-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
        _ip("-n", self.switch, "link", "set", h.port, "master", "br0", "up")
        _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _ip("-n", h.ns, "link", "set", "eth0", "up")
        self.hosts[name] = h
        self.shape(h, rate_bit)
        return h

    def shape(self, h: Host, rate_bit: float | None) -> None:
        """Set (or with None remove) the token bucket on both ends of ``h``'s link."""
        for ns, dev in ((h.ns, "eth0"), (self.switch, h.port)):
            if rate_bit is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
                continue
            # burst: at least a 64 KiB GSO segment, and 4 ms of the rate (kernel timers tick at >= 250 Hz)
            burst = max(256 << 10, int(rate_bit / 8 * 0.004))
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bit)}bit",
                            "burst", str(burst), "latency", "50ms"], check=True, capture_output=True, timeout=30)
        h.rate_bit = rate_bit

    def counters(self, h: Host) -> dict[str, int]:
        """Bytes and packets through ``h``'s eth0 since it was made (the kernel's counters)."""
        out = _ip("-n", h.ns, "-s", "-j", "link", "show", "eth0").stdout
        st = json.loads(out)[0]["stats64"]
        return {"rx_bytes": st["rx"]["bytes"], "tx_bytes": st["tx"]["bytes"],
                "rx_packets": st["rx"]["packets"], "tx_packets": st["tx"]["packets"]}

    def argv(self, h: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", h.ns, *argv]

    def popen(self, h: Host, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``h``'s namespace; it is ended by :meth:`close` if still running."""
        p = subprocess.Popen(self.argv(h, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, h: Host, argv: list[str], *, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(h, argv), timeout=timeout, **kw)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)   # its own session: ip netns exec and what it exec'd
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self.procs.clear()
        for ns in reversed(self._namespaces):   # deleting a namespace deletes its veth ends and the bridge
            _ip("netns", "del", ns, check=False)
        self._namespaces.clear()
        self.hosts.clear()
