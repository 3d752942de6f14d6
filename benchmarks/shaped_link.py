"""A real, shaped network link between two Linux network namespaces, for end-to-end benchmarks.

Two namespaces (``<prefix>-a`` and ``<prefix>-b``) joined by a veth pair; both ends get a
token-bucket filter (``tc qdisc ... tbf``), so traffic between ``10.77.0.1`` (side a) and
``10.77.0.2`` (side b) crosses the kernel's network stack at a real, enforced rate. The rate can
be changed while traffic flows (:meth:`ShapedLink.set_rate`), which is how a benchmark makes the
link drop mid-run. Needs root (``ip netns``, ``tc``); everything is removed on exit, including
after an error, and names are unique per process so runs cannot collide.

    with ShapedLink(rate_gbps=1.0) as link:
        subprocess.run(link.exec_prefix("b") + ["python", "server.py", "--host", link.address("b")])

Run this file to check the shaping on this machine (rates in Gbps, seconds per rate)::

    sudo python benchmarks/shaped_link.py [--rates 0.1,0.5,1,2,5,10] [--seconds 2]

It prints, per rate, the goodput a Python TCP sender reaches through the link next to the
configured rate, and the same sender's goodput with no shaping (the reference measured in the
same run): above that reference the link, not the shaper, is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

__all__ = ["LinkError", "ShapedLink", "tbf_burst_bytes"]

SUBNET = "10.77.0"
MTU = 65000  # veth carries jumbo frames: fewer packets per byte on 2 CPU cores


class LinkError(RuntimeError):
    """``ip``/``tc`` failed (not root, missing iproute2) or a rate is not a positive number."""


def tbf_burst_bytes(rate_gbps: float) -> int:
    """Token-bucket size for ``rate_gbps``: 4 ms of traffic, at least 4 full frames.

    A bucket smaller than ``rate x timer granularity`` caps the rate below the configured one;
    4 ms covers a 250 Hz kernel tick. Bytes.
    """
    return max(4 * MTU, int(rate_gbps * 1e9 / 8 * 0.004))


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkError(f"`{shlex.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass
class ShapedLink:
    """Two namespaces joined by a veth pair shaped to ``rate_gbps`` in both directions.

    Attributes:
        rate_gbps: the shaped rate, Gbps (1e9 bit/s); ``None`` leaves the link unshaped.
        prefix: namespace name prefix; the process id is appended.

    Raises:
        LinkError: on entering, when a command fails (e.g. not root); on :meth:`set_rate`, for
            a rate that is not finite and positive.
    """

    rate_gbps: float | None = 1.0
    prefix: str = "kvt"
    names: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        tag = f"{self.prefix}{os.getpid() % 100000}"
        self.names = {"a": f"{tag}a", "b": f"{tag}b"}
        self._created: list[str] = []

    def address(self, side: str) -> str:
        """IPv4 address of side ``"a"`` or ``"b"``."""
        return f"{SUBNET}.{1 if side == 'a' else 2}"

    def exec_prefix(self, side: str) -> list[str]:
        """Command prefix that runs a program inside side ``"a"`` or ``"b"``'s namespace."""
        return ["ip", "netns", "exec", self.names[side]]

    def _qdisc(self, verb: str, side: str, rate_gbps: float | None) -> None:
        dev = f"{self.names[side]}0"
        base = ["ip", "netns", "exec", self.names[side], "tc", "qdisc", verb, "dev", dev, "root"]
        if rate_gbps is None:
            if verb != "add":
                _run(["ip", "netns", "exec", self.names[side], "tc", "qdisc", "del", "dev", dev, "root"])
            return
        rate = f"{rate_gbps * 1e9:.0f}bit"
        _run(base + ["tbf", "rate", rate, "burst", str(tbf_burst_bytes(rate_gbps)), "latency", "200ms"])

    def set_rate(self, rate_gbps: float) -> None:
        """Change the shaped rate of both directions now (traffic in flight continues)."""
        if not (isinstance(rate_gbps, (int, float)) and 0 < rate_gbps < float("inf")):
            raise LinkError(f"rate must be a finite positive number of Gbps, got {rate_gbps!r}")
        for side in ("a", "b"):
            self._qdisc("replace", side, float(rate_gbps))
        self.rate_gbps = float(rate_gbps)

    def __enter__(self) -> "ShapedLink":
        try:
            for side in ("a", "b"):
                _run(["ip", "netns", "add", self.names[side]])
                self._created.append(self.names[side])
                _run(["ip", "netns", "exec", self.names[side], "ip", "link", "set", "lo", "up"])
            a, b = self.names["a"], self.names["b"]
            _run(["ip", "link", "add", f"{a}0", "netns", a, "type", "veth", "peer", "name", f"{b}0", "netns", b])
            for side in ("a", "b"):
                ns, dev = self.names[side], f"{self.names[side]}0"
                _run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(side)}/24", "dev", dev])
                _run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "mtu", str(MTU), "up"])
                if self.rate_gbps is not None:
                    self._qdisc("add", side, self.rate_gbps)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete the namespaces (and with them the veth pair); idempotent."""
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True)

    def __exit__(self, *exc) -> None:
        self.close()


def _sink(port: int, ready: threading.Event) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        ready.set()
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 20):
                pass


def _goodput_gbps(link: ShapedLink, seconds: float, port: int = 47001) -> float:
    """Goodput of one TCP stream from side a to side b for ``seconds``, Gbps."""
    sink = subprocess.Popen(
        link.exec_prefix("b") + [sys.executable, __file__, "--sink", str(port)], stdout=subprocess.PIPE
    )
    try:
        sink.stdout.readline()  # "ready"
        code = (
            "import socket,time,sys\n"
            f"s=socket.create_connection(('{link.address('b')}',{port}));buf=bytes(1<<20);n=0\n"
            f"t0=time.perf_counter()\nwhile time.perf_counter()-t0<{seconds}:\n s.sendall(buf);n+=len(buf)\n"
            "s.shutdown(socket.SHUT_WR);s.recv(1);print(n/(time.perf_counter()-t0)*8/1e9)"
        )
        out = subprocess.run(link.exec_prefix("a") + [sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return float(out.stdout.strip())
    finally:
        sink.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.1,0.5,1,2,5,10", help="comma-separated Gbps")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sink:
        ready = threading.Event()
        t = threading.Thread(target=_sink, args=(args.sink, ready))
        t.start()
        ready.wait()
        print("ready", flush=True)
        t.join()
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with ShapedLink(rate_gbps=None) as link:
        ref = _goodput_gbps(link, args.seconds)
    print(f"unshaped veth, one Python TCP stream: {ref:.2f} Gbps (reference)")
    print(f"{'rate Gbps':>10} {'goodput Gbps':>13} {'goodput/rate':>13}")
    for rate in rates:
        with ShapedLink(rate_gbps=rate) as link:
            got = _goodput_gbps(link, args.seconds)
        print(f"{rate:>10g} {got:>13.3f} {got / rate:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
