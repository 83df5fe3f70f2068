"""An emulated cluster network: one namespace per worker, one bridge, shaped links.

Host ``i`` is the network namespace ``<prefix>i`` holding ``eth0`` with the
address ``<subnet>.(i + 1)/24``, the other end of a veth pair whose end
``<prefix>v<i>`` is a port of the bridge ``<prefix>br`` in the root namespace.
The bridge has no address: the hosts reach each other and nothing else. Each
link is shaped in both directions with a token bucket (``tc ... tbf``): on
``eth0`` in the namespace (what the host sends) and on the bridge's port (what
it receives), the full-duplex NIC of a host on a switch. ``latency_us`` adds a
``netem`` delay below the token bucket on ``eth0`` where the kernel has it.

gloo finds its own address by resolving the host name; ``ip netns exec``
bind-mounts ``/etc/netns/<name>/hosts`` over ``/etc/hosts``, so each host gets
a hosts file mapping the host name to its own address.

:meth:`Network.down` removes the links, namespaces and hosts files; it is
idempotent and also removes whatever an earlier run with the same prefix left
behind (:meth:`Network.up` calls it first).

Run as a module it is the latency probe :meth:`Network.one_way_latency_us`
uses: ``python -m experiments.netbench.network serve|ping ADDRESS PORT``.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

NETNS_DIR = "/etc/netns"
_PROBE_ROUNDS = 200


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(list(args), check=check, capture_output=True, text=True)


def available() -> Optional[str]:
  """``None`` when namespaces can be made here, else why not."""
  if os.geteuid() != 0:
    return "not root"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"`{tool}` not found"
  return None


def _rate(bandwidth_gbit: float) -> str:
  return f"{int(round(bandwidth_gbit * 1e6))}kbit"


class Network:
  """``num_hosts`` namespaces on one bridge (see the module docstring).

  Args:
    num_hosts: hosts (namespaces), 1 to 250.
    prefix: names of everything made here start with it (at most 8
      characters, so that interface names fit in 15).
    subnet: the first three octets of the private /24 the hosts live in.
  """

  interface = "eth0"

  def __init__(self, num_hosts: int, prefix: str = "jcnb", subnet: str = "10.213.47"):
    if not 1 <= num_hosts <= 250:
      raise ValueError(f"`num_hosts` must be in [1, 250], got {num_hosts}")
    if not prefix or len(prefix) > 8 or not prefix.isalnum():
      raise ValueError(f"`prefix` must be 1 to 8 letters or digits, got {prefix!r}")
    self.num_hosts = num_hosts
    self.prefix = prefix
    self.subnet = subnet
    self.bridge = f"{prefix}br"
    self.bandwidth_gbit: Optional[float] = None
    self.latency_us = 0.0

  def namespace(self, host: int) -> str:
    return f"{self.prefix}{host}"

  def port(self, host: int) -> str:
    """The bridge-side end of ``host``'s veth pair, in the root namespace."""
    return f"{self.prefix}v{host}"

  def address(self, host: int) -> str:
    return f"{self.subnet}.{host + 1}"

  def exec_prefix(self, host: int) -> list[str]:
    """Prepend to a command to run it on ``host``."""
    return ["ip", "netns", "exec", self.namespace(host)]

  def up(self) -> None:
    """Creates the namespaces, links and hosts files (after removing leftovers)."""
    self.down()
    _run(["ip", "link", "add", self.bridge, "type", "bridge"])
    _run(["ip", "link", "set", self.bridge, "up"])
    hostname = socket.gethostname()
    for host in range(self.num_hosts):
      ns = self.namespace(host)
      _run(["ip", "netns", "add", ns])
      _run(["ip", "link", "add", self.port(host), "type", "veth", "peer", "name",
            self.interface, "netns", ns])
      _run(["ip", "link", "set", self.port(host), "master", self.bridge])
      _run(["ip", "link", "set", self.port(host), "up"])
      _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", self.interface])
      _run(["ip", "-n", ns, "link", "set", self.interface, "up"])
      _run(["ip", "-n", ns, "link", "set", "lo", "up"])
      os.makedirs(os.path.join(NETNS_DIR, ns), exist_ok=True)
      with open(os.path.join(NETNS_DIR, ns, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(host)} {hostname}\n")

  def shape(self, bandwidth_gbit: float, latency_us: float = 0.0) -> None:
    """Limits every link to ``bandwidth_gbit`` each way, plus ``latency_us`` one way.

    Raises:
      RuntimeError: ``latency_us > 0`` and the kernel has no ``netem``.
    """
    if not bandwidth_gbit > 0:
      raise ValueError(f"`bandwidth_gbit` must be > 0, got {bandwidth_gbit}")
    if not latency_us >= 0:
      raise ValueError(f"`latency_us` must be >= 0, got {latency_us}")
    tbf = ["tbf", "rate", _rate(bandwidth_gbit), "burst", "256kb", "latency", "50ms"]
    for host in range(self.num_hosts):
      ns = self.namespace(host)
      _run(["tc", "-n", ns, "qdisc", "replace", "dev", self.interface, "root",
            "handle", "1:", *tbf])
      _run(["tc", "qdisc", "replace", "dev", self.port(host), "root", *tbf])
      if latency_us > 0:
        added = _run(["tc", "-n", ns, "qdisc", "replace", "dev", self.interface,
                      "parent", "1:1", "handle", "10:", "netem", "delay",
                      f"{latency_us:g}us"], check=False)
        if added.returncode != 0:
          raise RuntimeError(
              f"`--latency-us` {latency_us:g} needs the netem qdisc, which this"
              f" kernel lacks: {added.stderr.strip()}"
          )
    self.bandwidth_gbit = bandwidth_gbit
    self.latency_us = latency_us

  def qdiscs(self) -> list[str]:
    """``tc qdisc show`` of every link end (for the record and the tests)."""
    shown = []
    for host in range(self.num_hosts):
      shown.append(_run(["tc", "-n", self.namespace(host), "qdisc", "show", "dev",
                         self.interface], check=False).stdout.strip())
      shown.append(_run(["tc", "qdisc", "show", "dev", self.port(host)],
                        check=False).stdout.strip())
    return shown

  def leftovers(self) -> list[str]:
    """Namespaces, links and hosts files of this prefix that exist now."""
    found = []
    listed = _run(["ip", "netns", "list"], check=False).stdout.split()
    found += [n for n in listed if _ours(n, self.prefix)]
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
      name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
      if _ours(name, self.prefix) or name == self.bridge:
        found.append(name)
    if os.path.isdir(NETNS_DIR):
      found += [os.path.join(NETNS_DIR, n) for n in os.listdir(NETNS_DIR)
                if _ours(n, self.prefix)]
    return found

  def down(self) -> None:
    """Removes every namespace, link and hosts file of this prefix; never raises."""
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
      name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
      if _ours(name, self.prefix) and name != self.bridge:
        _run(["ip", "link", "del", name], check=False)
    for name in _run(["ip", "netns", "list"], check=False).stdout.split():
      if _ours(name, self.prefix):
        _run(["ip", "netns", "del", name], check=False)
    _run(["ip", "link", "del", self.bridge], check=False)
    if os.path.isdir(NETNS_DIR):
      for name in os.listdir(NETNS_DIR):
        if _ours(name, self.prefix):
          shutil.rmtree(os.path.join(NETNS_DIR, name), ignore_errors=True)
      if not os.listdir(NETNS_DIR):
        os.rmdir(NETNS_DIR)
    self.bandwidth_gbit = None

  def one_way_latency_us(self, port: int = 29400) -> float:
    """Half the median TCP round trip of one byte between hosts 0 and 1."""
    if self.num_hosts < 2:
      raise ValueError("the latency probe needs two hosts")
    module = [sys.executable, "-m", "experiments.netbench.network"]
    server = subprocess.Popen(
        self.exec_prefix(1) + module + ["serve", self.address(1), str(port)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
      server.stdout.readline()  # "ready"
      out = _run(self.exec_prefix(0) + module + ["ping", self.address(1), str(port)])
      return float(out.stdout.strip()) / 2
    finally:
      server.kill()
      server.wait()


def _ours(name: str, prefix: str) -> bool:
  """``prefix`` followed by ``br``, ``v<digits>`` or ``<digits>``: a name we make."""
  if not name.startswith(prefix):
    return False
  rest = name[len(prefix):]
  return rest == "br" or rest.isdigit() or (rest[:1] == "v" and rest[1:].isdigit())


def _serve(address: str, port: int) -> None:
  listener = socket.socket()
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  listener.bind((address, port))
  listener.listen(1)
  print("ready", flush=True)
  conn, _ = listener.accept()
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  while True:
    byte = conn.recv(1)
    if not byte:
      return
    conn.sendall(byte)


def _ping(address: str, port: int) -> float:
  """Median round trip in microseconds."""
  conn = socket.create_connection((address, port), timeout=10)
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  times = []
  for _ in range(_PROBE_ROUNDS):
    start = time.perf_counter()
    conn.sendall(b"x")
    conn.recv(1)
    times.append(time.perf_counter() - start)
  conn.close()
  return statistics.median(times) * 1e6


if __name__ == "__main__":
  role, where, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
  if role == "serve":
    _serve(where, at)
  else:
    print(_ping(where, at))
