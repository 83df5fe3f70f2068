"""An emulated cluster network: one namespace per worker, bridges, shaped links.

Host ``i`` is the network namespace ``<prefix>i`` holding ``eth0`` with the
address ``<subnet>.(i + 1)/24``, the other end of a veth pair whose end
``<prefix>v<i>`` is a port of a bridge in the root namespace. The bridges
have no address: the hosts reach each other and nothing else. Two layouts
(:func:`plan`):

* one level: every host on the bridge ``<prefix>br``, each host's link shaped
  in both directions with a token bucket (``tc ... tbf``): on ``eth0`` in the
  namespace (what the host sends) and on the bridge's port (what it
  receives), the full-duplex NIC of a host on a switch;
* two levels (``hosts_per_node``): node ``n`` (hosts ``n L`` to ``n L + L -
  1``) has its own bridge ``<prefix>br<n>``, the hosts' links unshaped, and an
  uplink to the switch ``<prefix>br``: the veth pair ``<prefix>u<n>`` (on the
  node's bridge) and ``<prefix>c<n>`` (on the switch), shaped on both ends,
  the full-duplex NIC of a node. Traffic inside a node never leaves its
  bridge; traffic between nodes crosses two uplinks, so the ``tx_bytes`` of
  every ``<prefix>u<n>`` add up to the bytes sent between nodes.

``latency_us`` adds a ``netem`` delay below the token bucket on the sending
end of each shaped link (``eth0``, or a node's ``u<n>``) where the kernel has it.

gloo finds its own address by resolving the host name; ``ip netns exec``
bind-mounts ``/etc/netns/<name>/hosts`` over ``/etc/hosts``, so each host gets
a hosts file mapping the host name to its own address.

:meth:`Network.down` removes the links, bridges, namespaces and hosts files;
it is idempotent and also removes whatever an earlier run with the same
prefix left behind (:meth:`Network.up` calls it first).

Run as a module it is the latency probe :meth:`Network.one_way_latency_us`
uses: ``python -m experiments.netbench.network serve|ping ADDRESS PORT``.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import NamedTuple, Optional, Sequence

NETNS_DIR = "/etc/netns"
INTERFACE = "eth0"
_PROBE_ROUNDS = 200
_TBF = ("burst", "256kb", "latency", "50ms")


# The probe runs this module with ``python -m``: from the repository root,
# which jaxcomp's wheel does not install.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args: Sequence[str], check: bool = True, cwd: Optional[str] = None
         ) -> subprocess.CompletedProcess:
  return subprocess.run(list(args), check=check, capture_output=True, text=True, cwd=cwd)


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


class End(NamedTuple):
  """One end of a veth pair.

  Attributes:
    device: its interface name.
    namespace: the namespace it lives in (``None``: the root namespace).
    bridge: the bridge it is a port of (``None``: a host's own interface).
  """

  device: str
  namespace: Optional[str] = None
  bridge: Optional[str] = None

  @property
  def vertex(self) -> str:
    """What it hangs on: its bridge, or the host (namespace) whose interface it is."""
    return self.bridge or self.namespace


class Plan(NamedTuple):
  """What :meth:`Network.up` makes and :meth:`Network.shape` shapes.

  Attributes:
    bridges: the bridges, in the root namespace.
    veths: the veth pairs.
    shaped: the ends whose egress a token bucket limits (one per direction
      of each shaped link).
    delayed: the shaped ends that also get the added latency (one per
      direction of a path between hosts).
    uplinks: root-namespace ends whose ``tx_bytes`` add up to the bytes sent
      between nodes (empty in one level).
  """

  bridges: tuple[str, ...]
  veths: tuple[tuple[End, End], ...]
  shaped: tuple[End, ...]
  delayed: tuple[End, ...]
  uplinks: tuple[End, ...]


def plan(num_hosts: int, prefix: str, hosts_per_node: Optional[int] = None) -> Plan:
  """The layout of the module docstring: one level, or nodes of ``hosts_per_node`` hosts."""
  switch = f"{prefix}br"

  def host_link(host: int, bridge: str) -> tuple[End, End]:
    return (End(f"{prefix}v{host}", bridge=bridge), End(INTERFACE, namespace=f"{prefix}{host}"))

  if hosts_per_node is None:
    hosts = tuple(host_link(h, switch) for h in range(num_hosts))
    return Plan(bridges=(switch,), veths=hosts,
                shaped=tuple(end for port, eth in hosts for end in (eth, port)),
                delayed=tuple(eth for _, eth in hosts), uplinks=())
  nodes = num_hosts // hosts_per_node
  bridges = tuple(f"{prefix}br{n}" for n in range(nodes))
  hosts = tuple(host_link(h, bridges[node_of(h, hosts_per_node)]) for h in range(num_hosts))
  uplinks = tuple((End(f"{prefix}u{n}", bridge=bridges[n]), End(f"{prefix}c{n}", bridge=switch))
                  for n in range(nodes))
  return Plan(bridges=(switch, *bridges), veths=hosts + uplinks,
              shaped=tuple(end for pair in uplinks for end in pair),
              delayed=tuple(up for up, _ in uplinks), uplinks=tuple(up for up, _ in uplinks))


def node_of(host: int, hosts_per_node: int) -> int:
  """The node of ``host``: hosts ``n L`` to ``n L + L - 1`` are node ``n``."""
  return host // hosts_per_node


def route(layout: Plan, source: str, target: str) -> list[End]:
  """The ends a packet from namespace ``source`` to ``target`` leaves through, in order."""
  links = collections.defaultdict(list)
  for a, b in layout.veths:
    links[a.vertex].append((a, b.vertex))
    links[b.vertex].append((b, a.vertex))
  paths = {source: []}
  frontier = collections.deque([source])
  while frontier:
    here = frontier.popleft()
    for end, there in links[here]:
      if there not in paths:
        paths[there] = paths[here] + [end]
        frontier.append(there)
  if target not in paths:
    raise ValueError(f"no path from {source!r} to {target!r}")
  return paths[target]


def _tc(end: End) -> list[str]:
  return ["tc"] + (["-n", end.namespace] if end.namespace else [])


def _ip(end: End) -> list[str]:
  return ["ip"] + (["-n", end.namespace] if end.namespace else [])


class Network:
  """``num_hosts`` namespaces on bridges (see the module docstring).

  Args:
    num_hosts: hosts (namespaces), 1 to 250.
    prefix: names of everything made here start with it (at most 8
      characters, so that interface names fit in 15).
    subnet: the first three octets of the private /24 the hosts live in.
    hosts_per_node: ``None``: one level (every host link shaped); else the
      hosts per node of two levels (only the links between nodes shaped),
      a divisor of ``num_hosts`` leaving at least two nodes.
  """

  interface = INTERFACE

  def __init__(self, num_hosts: int, prefix: str = "jcnb", subnet: str = "10.213.47",
               hosts_per_node: Optional[int] = None):
    if not 1 <= num_hosts <= 250:
      raise ValueError(f"`num_hosts` must be in [1, 250], got {num_hosts}")
    if not prefix or len(prefix) > 8 or not prefix.isalnum():
      raise ValueError(f"`prefix` must be 1 to 8 letters or digits, got {prefix!r}")
    if hosts_per_node is not None and (
        hosts_per_node < 1 or num_hosts % hosts_per_node or num_hosts // hosts_per_node < 2):
      raise ValueError(
          f"`hosts_per_node` must divide `num_hosts` {num_hosts} into at least two nodes,"
          f" got {hosts_per_node}")
    self.num_hosts = num_hosts
    self.prefix = prefix
    self.subnet = subnet
    self.hosts_per_node = hosts_per_node
    self.plan = plan(num_hosts, prefix, hosts_per_node)
    self.bandwidth_gbit: Optional[float] = None
    self.latency_us = 0.0

  def namespace(self, host: int) -> str:
    return f"{self.prefix}{host}"

  def address(self, host: int) -> str:
    return f"{self.subnet}.{host + 1}"

  def exec_prefix(self, host: int) -> list[str]:
    """Prepend to a command to run it on ``host``."""
    return ["ip", "netns", "exec", self.namespace(host)]

  def up(self) -> None:
    """Creates the namespaces, bridges, links and hosts files (after removing leftovers)."""
    self.down()
    for bridge in self.plan.bridges:
      _run(["ip", "link", "add", bridge, "type", "bridge"])
      _run(["ip", "link", "set", bridge, "up"])
    hostname = socket.gethostname()
    for host in range(self.num_hosts):
      ns = self.namespace(host)
      _run(["ip", "netns", "add", ns])
      os.makedirs(os.path.join(NETNS_DIR, ns), exist_ok=True)
      with open(os.path.join(NETNS_DIR, ns, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(host)} {hostname}\n")
      _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    for a, b in self.plan.veths:
      _run(["ip", "link", "add", a.device, "type", "veth", "peer", "name", b.device]
           + (["netns", b.namespace] if b.namespace else []))
      for end in (a, b):
        if end.bridge:
          _run(_ip(end) + ["link", "set", end.device, "master", end.bridge])
        _run(_ip(end) + ["link", "set", end.device, "up"])
    for host in range(self.num_hosts):
      _run(["ip", "-n", self.namespace(host), "addr", "add", f"{self.address(host)}/24",
            "dev", self.interface])

  def shape(self, bandwidth_gbit: float, latency_us: float = 0.0) -> None:
    """Limits every shaped link to ``bandwidth_gbit`` each way, plus ``latency_us`` one way.

    Raises:
      RuntimeError: ``latency_us > 0`` and the kernel has no ``netem``.
    """
    if not bandwidth_gbit > 0:
      raise ValueError(f"`bandwidth_gbit` must be > 0, got {bandwidth_gbit}")
    if not latency_us >= 0:
      raise ValueError(f"`latency_us` must be >= 0, got {latency_us}")
    tbf = ["tbf", "rate", _rate(bandwidth_gbit), *_TBF]
    for end in self.plan.shaped:
      _run(_tc(end) + ["qdisc", "replace", "dev", end.device, "root", "handle", "1:", *tbf])
    for end in self.plan.delayed if latency_us > 0 else ():
      added = _run(_tc(end) + ["qdisc", "replace", "dev", end.device, "parent", "1:1",
                               "handle", "10:", "netem", "delay", f"{latency_us:g}us"],
                   check=False)
      if added.returncode != 0:
        raise RuntimeError(
            f"`--latency-us` {latency_us:g} needs the netem qdisc, which this"
            f" kernel lacks: {added.stderr.strip()}"
        )
    self.bandwidth_gbit = bandwidth_gbit
    self.latency_us = latency_us

  def unshape(self) -> None:
    """Removes the token buckets (and delays): every link at the speed of the machine."""
    for end in self.plan.shaped:
      _run(_tc(end) + ["qdisc", "del", "dev", end.device, "root"], check=False)
    self.bandwidth_gbit = None
    self.latency_us = 0.0

  def qdiscs(self) -> list[str]:
    """``tc qdisc show`` of every shaped link end (for the record and the tests)."""
    return [self.qdisc(end) for end in self.plan.shaped]

  def qdisc(self, end: End) -> str:
    """``tc qdisc show`` of one link end."""
    return _run(_tc(end) + ["qdisc", "show", "dev", end.device], check=False).stdout.strip()

  def leftovers(self) -> list[str]:
    """Namespaces, links and hosts files of this prefix that exist now."""
    found = []
    listed = _run(["ip", "netns", "list"], check=False).stdout.split()
    found += [n for n in listed if _ours(n, self.prefix)]
    found += self._links()
    if os.path.isdir(NETNS_DIR):
      found += [os.path.join(NETNS_DIR, n) for n in os.listdir(NETNS_DIR)
                if _ours(n, self.prefix)]
    return found

  def _links(self) -> list[str]:
    """Links (veths and bridges) of this prefix in the root namespace."""
    found = []
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
      name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
      if _ours(name, self.prefix):
        found.append(name)
    return found

  def down(self) -> None:
    """Removes every namespace, link, bridge and hosts file of this prefix; never raises."""
    for name in self._links():
      _run(["ip", "link", "del", name], check=False)
    for name in _run(["ip", "netns", "list"], check=False).stdout.split():
      if _ours(name, self.prefix):
        _run(["ip", "netns", "del", name], check=False)
    if os.path.isdir(NETNS_DIR):
      for name in os.listdir(NETNS_DIR):
        if _ours(name, self.prefix):
          shutil.rmtree(os.path.join(NETNS_DIR, name), ignore_errors=True)
      if not os.listdir(NETNS_DIR):
        os.rmdir(NETNS_DIR)
    self.bandwidth_gbit = None

  def one_way_latency_us(self, port: int = 29400) -> float:
    """Half the median TCP round trip of one byte between the first and the last host.

    In two levels they sit on different nodes: the round trip crosses the uplinks.
    """
    if self.num_hosts < 2:
      raise ValueError("the latency probe needs two hosts")
    last = self.num_hosts - 1
    module = [sys.executable, "-m", "experiments.netbench.network"]
    server = subprocess.Popen(
        self.exec_prefix(last) + module + ["serve", self.address(last), str(port)],
        stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
    )
    try:
      server.stdout.readline()  # "ready"
      out = _run(self.exec_prefix(0) + module + ["ping", self.address(last), str(port)],
                 cwd=REPO_ROOT)
      return float(out.stdout.strip()) / 2
    finally:
      server.kill()
      server.wait()


def _ours(name: str, prefix: str) -> bool:
  """``prefix`` followed by ``<digits>``, ``br[<digits>]``, ``v``, ``u`` or ``c`` and digits:
  a name we make."""
  if not name.startswith(prefix):
    return False
  rest = name[len(prefix):]
  if rest.startswith("br"):
    return rest == "br" or rest[2:].isdigit()
  return rest.isdigit() or (rest[:1] in ("v", "u", "c") and rest[1:].isdigit())


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
