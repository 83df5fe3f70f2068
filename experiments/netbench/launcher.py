"""The netbench launcher: network, workers, time-outs, results.

For each method it starts ``--processes`` workers (:mod:`.worker` for
jaxcomp's methods, :mod:`.torch_peer` for the torch rows), one per namespace;
they compile once, then for each bandwidth the launcher shapes the links
(:mod:`.network`) and lets them time their steps (one phase per bandwidth),
and it adds one row per bandwidth to the JSON. Every wait has a time-out: a
run whose worker fails or hangs is killed (every worker's process group),
recorded with its error and the tail of a worker's log, and the benchmark
goes on. The network is removed on every way out: a normal end, an
exception, Ctrl-C, SIGTERM, SIGHUP.

``--two-level``: nodes of ``--local-size`` processes on a mesh ``(node,
local)``, only the links between nodes shaped (:func:`network.plan`), the
rows of :data:`workload.TWO_LEVEL_ROWS`, and after the shaped bandwidths one
more phase with the shaping removed (the step at the machine's speed, in
place of the compute alone)."""

from __future__ import annotations

import argparse
import datetime
from fractions import Fraction
import importlib.util
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from experiments.netbench import network as network_lib
from experiments.netbench import report
from experiments.netbench import workload

REPO_ROOT = network_lib.REPO_ROOT
DEFAULT_OUT = os.path.join("experiments", "results", "netbench.json")
DEFAULT_PIPELINED_OUT = os.path.join("experiments", "results", "netbench_pipelined.json")
DEFAULT_TWO_LEVEL_OUT = os.path.join("experiments", "results", "netbench_two_level.json")
_BASE_PORT = 29500
_GRACE_S = 20.0
_LOG_TAIL = 3000

# Workers of the run in progress, killed on any way out.
_active: list[subprocess.Popen] = []


class Stopped(BaseException):
  """SIGTERM or SIGHUP arrived; unwinds through every ``finally``."""


def _stop(signum, frame):
  del frame
  raise Stopped(signal.Signals(signum).name)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m experiments.netbench",
      description=(
          "Times one gradient exchange step (compress, communicate, decompress)"
          " of every method with P worker processes over an emulated network:"
          " one network namespace per worker on one bridge, each link shaped"
          " with tc tbf to the given bandwidth both ways. Needs root, `ip` and"
          " `tc`; otherwise (or with --no-netns) the workers talk over"
          " loopback without shaping, and the output says so."),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
      "--methods", default="all",
      help=f"comma-separated methods, or 'all': {', '.join(workload.method_names())};"
           f" with --two-level: {', '.join(workload.TWO_LEVEL_ROWS)}; with --pipelined:"
           f" {', '.join(workload.PIPELINED_ROWS)}")
  parser.add_argument(
      "--pipelined", action="store_true",
      help="also time a whole training step (forward, backward, exchange, SGD) of a chain"
           " of layers shaped like the gradient, each method in one bucket and in"
           f" {workload.PIPELINED_CAP_MB:g} MiB buckets (the _buckets rows), against its"
           " compute alone plus the exchange of the update alone: was the exchange hidden?")
  parser.add_argument(
      "--two-level", action="store_true",
      help="nodes of --local-size processes: a mesh (node, local), the links inside a"
           " node unshaped, each node's uplink shaped to the bandwidth; two-level rows"
           " (flat ring, 2D torus, flat and hierarchical compressors)")
  parser.add_argument("--local-size", type=int, default=2,
                      help="with --two-level: processes per node")
  parser.add_argument(
      "--bandwidths", default="1,10",
      help="comma-separated link bandwidths in Gbit/s (ignored on loopback)")
  parser.add_argument("--processes", type=int, default=4,
                      help="worker processes P, one CPU device each")
  parser.add_argument("--steps", type=int, default=10,
                      help="timed steps per run (after the warm-up)")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps before the timed ones")
  parser.add_argument("--compute-steps", type=int, default=5,
                      help="timed steps of the same update without the network")
  parser.add_argument("--model", default="resnet50", choices=sorted(workload.MODELS),
                      help="whose gradient shapes are exchanged")
  parser.add_argument("--size", type=int, default=None,
                      help="instead of --model, a small stand-in of about this many floats")
  parser.add_argument("--out", default=None,
                      help="the JSON; the markdown table (.md) and the plot (.png) go beside it"
                           f" (default {DEFAULT_OUT}, with --two-level {DEFAULT_TWO_LEVEL_OUT},"
                           f" with --pipelined {DEFAULT_PIPELINED_OUT})")
  parser.add_argument("--no-netns", action="store_true",
                      help="run over loopback without shaping even as root")
  parser.add_argument("--latency-us", type=float, default=0.0,
                      help="one-way latency added with netem (needs netem) to every link, with"
                           " --two-level to the links between nodes")
  parser.add_argument("--timeout", type=float, default=900.0,
                      help="seconds each wait of a method's run may take (start and compile plus the"
                           " first bandwidth, each further bandwidth, the compute and exit)"
                           " before its workers are killed and the failure recorded")
  parser.add_argument("--seed", type=int, default=0, help="seed of the gradients")
  parser.add_argument("--netns-prefix", default="jcnb",
                      help="prefix of the namespaces, links and hosts files made (and removed)")
  parser.add_argument("--no-report", action="store_true",
                      help="write the JSON only (no markdown, no plot)")
  args = parser.parse_args(argv)
  if args.two_level and args.pipelined:
    parser.error("--pipelined runs on one level: drop --two-level")
  names = (list(workload.TWO_LEVEL_ROWS) if args.two_level else
           list(workload.PIPELINED_ROWS) if args.pipelined else workload.method_names())
  args.methods = names if args.methods == "all" else [m for m in args.methods.split(",") if m]
  unknown = [m for m in args.methods if m not in names]
  if unknown:
    parser.error(f"--methods: unknown {unknown}; known: {', '.join(names)}")
  args.bandwidths = [float(b) for b in args.bandwidths.split(",") if b]
  if not args.bandwidths or any(not b > 0 for b in args.bandwidths):
    parser.error(f"--bandwidths must be positive numbers, got {args.bandwidths}")
  if args.processes < 2:
    parser.error(f"--processes must be >= 2, got {args.processes}")
  if args.two_level and (args.local_size < 1 or args.processes % args.local_size
                         or args.processes // args.local_size < 2):
    parser.error(f"--two-level: --local-size {args.local_size} must split --processes"
                 f" {args.processes} into at least two nodes")
  if args.out is None:
    args.out = (DEFAULT_TWO_LEVEL_OUT if args.two_level else
                DEFAULT_PIPELINED_OUT if args.pipelined else DEFAULT_OUT)
  if args.steps < 1 or args.warmup < 0 or args.compute_steps < 1:
    parser.error("--steps and --compute-steps must be >= 1, --warmup >= 0")
  if args.size is not None and args.size < 256:
    parser.error(f"--size must be >= 256, got {args.size}")
  if not args.latency_us >= 0:
    parser.error(f"--latency-us must be >= 0, got {args.latency_us}")
  if not args.timeout > 0:
    parser.error(f"--timeout must be > 0, got {args.timeout}")
  return args


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _kill(procs: Sequence[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for proc in procs:
    proc.wait()


def _wait(procs: Sequence[subprocess.Popen], timeout: float,
          done: Optional[Callable[[], bool]] = None) -> str:
  """Until ``done()`` (default: every worker exited 0): ``"ok"``, ``"failed"`` or ``"timeout"``.

  A worker that exits non-zero fails the run: the others may wait in a
  collective for ever, so after a grace period they are killed. So are all
  of them on a time-out.
  """
  deadline = time.monotonic() + timeout
  failed_at = None
  while True:
    codes = [p.poll() for p in procs]
    if done is not None and done():
      return "ok"
    if all(c is not None for c in codes):
      return "ok" if done is None and all(c == 0 for c in codes) else "failed"
    now = time.monotonic()
    if failed_at is None and any(c not in (None, 0) for c in codes):
      failed_at = now
    if failed_at is not None and now - failed_at > _GRACE_S:
      _kill(procs)
      return "failed"
    if now > deadline:
      _kill(procs)
      return "timeout"
    time.sleep(0.2)


def _tail(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-_LOG_TAIL:]
  except OSError:
    return ""


def _load(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {"error": f"{os.path.basename(path)}: no result written"}


def worker_env(interface: Optional[str]) -> dict[str, str]:
  """A worker's environment: gloo on ``interface``, the repository importable, CPU only.

  Every worker runs on the CPU: JAX's platform is set, and the GPU is hidden
  (``CUDA_VISIBLE_DEVICES`` empty), without which torch's DDP on a machine
  with a GPU fails on CPU tensors (``Expected a cuda device, but got: cpu``).
  """
  return dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
              GLOO_SOCKET_IFNAME=interface or "lo",
              PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))


def mesh_shape(args: argparse.Namespace) -> Optional[dict[str, int]]:
  """The two-level mesh ``{node: nodes, local: L}`` (``None`` in one level)."""
  if not args.two_level:
    return None
  slow, fast = workload.MESH_AXES
  return {slow: args.processes // args.local_size, fast: args.local_size}


def _median_of_max(per_worker: list[list[float]]) -> tuple[float, list[float]]:
  """Step ``i`` lasts as long as its slowest worker; the median over steps."""
  steps = [max(ts) for ts in zip(*per_worker)]
  return statistics.median(steps), steps


class Bench:
  """One benchmark: the arguments, the network (or loopback), the rows so far."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    self.mesh_shape = mesh_shape(args)
    self.shapes = workload.gradient_shapes(args.model, args.size)
    import jax  # the launcher never starts a backend; shapes only
    self.params = sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))
    self.net: Optional[network_lib.Network] = None
    self.runs: list[dict] = []
    self.port = _BASE_PORT
    reason = "--no-netns given" if args.no_netns else network_lib.available()
    self.network = {"mode": "loopback" if reason else "netns", "fallback_reason": reason}
    if reason:
      print(f"netbench: no network emulation ({reason}): loopback, no shaping,"
            " bandwidths ignored", flush=True)

  # ------------------------------------------------------------- one run

  def _coordinator(self) -> str:
    self.port += 1
    if self.net is None:
      return f"127.0.0.1:{_free_port()}"
    return f"{self.net.address(0)}:{self.port}"

  def _command(self, method: str, host: int, spec_path: str) -> list[str]:
    module = "torch_peer" if workload.is_torch(method) else "worker"
    cmd = [sys.executable, "-m", f"experiments.netbench.{module}", spec_path]
    return (self.net.exec_prefix(host) if self.net else []) + cmd

  def run_method(self, method: str, bandwidths: Sequence[Optional[float]]) -> list[dict]:
    """One row per bandwidth: the same workers, compiled once, over each in turn."""
    args = self.args
    rows = [{
        "method": method,
        "bandwidth_gbit": bandwidth,
        "processes": args.processes,
        "params": self.params,
        "config": workload.config(method),
        "status": None,
        "step_time_s": None,
        "comm_bytes": None,
        "interface_bytes": None,
        "predicted_step_s": None,
    } for bandwidth in bandwidths]
    tx, why = self._compressor(method)
    if tx is None:
      for row in rows:
        row.update(status="unavailable", error=why)
      return rows
    from jaxcomp import wire
    expected = wire.expected_bytes(tx, self.shapes, self.mesh_shape or args.processes)
    interface = self.net.interface if self.net is not None else None
    uplinks = [end.device for end in self.net.plan.uplinks] if self.net is not None else []
    with tempfile.TemporaryDirectory(prefix="netbench-") as tmp:
      coordinator = self._coordinator()
      procs = []
      for host in range(args.processes):
        spec = {
            "method": method,
            "config": rows[0]["config"],
            "mesh_shape": self.mesh_shape,
            "pipelined": args.pipelined,
            "launcher_pid": os.getpid(),
            "uplinks": uplinks if host == 0 else [],
            "process_id": host,
            "num_processes": args.processes,
            "coordinator": coordinator,
            "model": args.model,
            "size": args.size,
            "steps": args.steps,
            "warmup": args.warmup,
            "compute_steps": args.compute_steps,
            "seed": args.seed,
            "interface": interface,
            "phases": len(bandwidths),
            "sync_dir": tmp,
            "phase_timeout_s": args.timeout,
            "init_timeout_s": max(30, int(args.timeout)),
            "out": os.path.join(tmp, f"result{host}.json"),
        }
        spec_path = os.path.join(tmp, f"spec{host}.json")
        with open(spec_path, "w") as f:
          json.dump(spec, f)
        with open(os.path.join(tmp, f"log{host}.txt"), "w") as log:
          proc = subprocess.Popen(self._command(method, host, spec_path), cwd=REPO_ROOT,
                                  env=worker_env(interface), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        _active.append(proc)
      status = "ok"
      phases = []
      try:
        for phase, bandwidth in enumerate(bandwidths):
          if self.net is not None:
            if bandwidth is None:
              self.net.unshape()
            else:
              self.net.shape(bandwidth, args.latency_us)
            self.network.setdefault("qdiscs", {}).setdefault(
                report.bandwidth_key(bandwidth), self.net.qdiscs())
          with open(workload.phase_path(tmp, phase), "w"):
            pass
          paths = [workload.phase_result_path(tmp, h, phase) for h in range(args.processes)]
          status = _wait(procs, args.timeout, lambda: all(map(os.path.exists, paths)))
          if status != "ok":
            break
          phases.append([_load(path) for path in paths])
        if status == "ok":
          status = _wait(procs, args.timeout)
      finally:
        _kill(procs)
        for proc in procs:
          _active.remove(proc)
      finals = [_load(os.path.join(tmp, f"result{h}.json")) for h in range(args.processes)]
      workers = [{"process": h, "pid": p.pid, "exit_code": p.returncode}
                 for h, p in enumerate(procs)]
      error = next((r["error"] for r in finals if "error" in r), None)
      log_tail = _tail(os.path.join(tmp, "log0.txt"))
    for phase, row in enumerate(rows):
      row.update(status=status, workers=workers, expected_bytes=float(expected.total))
      if self.mesh_shape:
        row["expected_bytes_by_axes"] = {"+".join(k): float(v) for k, v in expected.by_axes.items()}
      if phase < len(phases):
        self._fill_phase(row, phases[phase], tx, finals)
      if status != "ok":
        row["error"] = error or f"{status} (time-out {args.timeout:g} s per phase)"
        row["log_tail"] = log_tail
    unshaped = [r for r in rows if r["bandwidth_gbit"] is None and r["step_time_s"] is not None]
    if self.mesh_shape and unshaped:
      for row in rows:
        row["unshaped_step_s"] = unshaped[0]["step_time_s"]
    return rows

  def _compressor(self, method: str):
    """``(compressor, None)`` of a row (the torch rows: their twin), or ``(None, why)``."""
    if workload.is_torch(method) and importlib.util.find_spec("torch") is None:
      return None, "torch is not installed (pip install 'jaxcomp[peers]')"
    return workload.build(method, self.mesh_shape), None

  def _fill_phase(self, row: dict, phase: list[dict], tx, finals: list[dict]) -> None:
    """A row's numbers from one phase's results and, when they came, the final ones."""
    args = self.args
    step_s, per_step = _median_of_max([r["step_times_s"] for r in phase])
    row["step_time_s"] = step_s
    row["step_times_s"] = per_step
    row["mean_step_s"] = statistics.fmean(per_step)
    sent = [r["tx_bytes"] for r in phase]
    if all(s is not None for s in sent):
      row["interface_bytes"] = statistics.fmean(sent) / args.steps
      row["interface_bytes_max"] = max(sent) / args.steps
    if any("output_sha256" not in r for r in finals):
      return
    row["outputs_identical"] = len({r["output_sha256"] for r in finals}) == 1
    first = finals[0]
    if "collective_bytes" in first:
      row["comm_bytes"] = float(Fraction(first["collective_bytes"]))
      row["comm_bytes_by_kind"] = {
          k: float(Fraction(v)) for k, v in first["collective_bytes_by_kind"].items()}
      row["compile_s"] = max(r["compile_s"] for r in finals)
      if self.mesh_shape:
        self._fill_links(row, phase, first)
    else:
      row["ddp_bucket_sizes"] = first["ddp_bucket_sizes"]
      row["torch_version"] = first["torch_version"]
    if any("compute_times_s" not in r for r in finals):
      return
    compute_s, _ = _median_of_max([r["compute_times_s"] for r in finals])
    row["compute_s"] = compute_s
    row["exchange_s"] = step_s - compute_s
    if "train_step_times_s" in phase[0]:
      self._fill_training(row, phase, finals)
    if row["bandwidth_gbit"] is not None:
      from jaxcomp import costmodel
      latency = self.network.get("model_latency_us", 0.0)
      row["predicted_step_s"] = costmodel.predict(
          tx, self.shapes, args.processes, row["bandwidth_gbit"], latency,
          compute_s=compute_s)
      row["predicted_over_measured"] = row["predicted_step_s"] / step_s

  def _fill_training(self, row: dict, phase: list[dict], finals: list[dict]) -> None:
    """A pipelined row's training step against its compute alone plus the update's exchange.

    ``hidden_s``: how much shorter the step is than its compute (forward,
    backward, compression, SGD on one device) plus the exchange the update
    alone spends over the network (``exchange_s``); above zero, part of the
    exchange ran while the step computed.
    """
    row["train_step_s"], row["train_step_times_s"] = _median_of_max(
        [r["train_step_times_s"] for r in phase])
    row["train_compute_s"], _ = _median_of_max([r["train_compute_times_s"] for r in finals])
    serial = row["train_compute_s"] + max(row["exchange_s"], 0.0)
    row["serial_s"] = serial
    row["hidden_s"] = serial - row["train_step_s"]

  def _fill_links(self, row: dict, phase: list[dict], first: dict) -> None:
    """Two levels: bytes by axes of the program, and per link of program, formula, counters."""
    row["comm_bytes_by_axes"] = {
        k: float(Fraction(v)) for k, v in first["collective_bytes_by_axes"].items()}
    links = {"program": report.axes_link_bytes(row["comm_bytes_by_axes"], self.mesh_shape),
             "formula": report.axes_link_bytes(row["expected_bytes_by_axes"], self.mesh_shape)}
    sent = [r["tx_bytes"] for r in phase]
    uplink = phase[0]["uplink_tx_bytes"]
    if uplink is not None and all(s is not None for s in sent):
      links["counters"] = report.counter_link_bytes(sent, uplink, self.args.steps)
    row["link_bytes"] = links

  # ----------------------------------------------------------- the bench

  def _links(self) -> str:
    """The network's links, in words."""
    tbf = "tc tbf rate <bandwidth> burst 256kb latency 50ms on both ends"
    if not self.mesh_shape:
      return f"one namespace per worker, veth to one bridge, {tbf}"
    return (f"one namespace per worker, {self.args.local_size} per node on the node's bridge"
            " by unshaped veths; each node's bridge joined to one switch bridge by a veth"
            f" uplink, {tbf} of each uplink; last phase: every link unshaped")

  def config(self) -> dict:
    args = self.args
    versions = {"python": sys.version.split()[0]}
    for module in ("jax", "jaxlib", "optax", "torch"):
      if importlib.util.find_spec(module) is not None:
        versions[module] = importlib.import_module(module).__version__
    return {
        "processes": args.processes,
        "mesh_shape": self.mesh_shape,
        "bandwidths_gbit": args.bandwidths if self.net else [],
        "methods": args.methods,
        "pipelined": args.pipelined,
        "steps": args.steps,
        "warmup": args.warmup,
        "compute_steps": args.compute_steps,
        "model": None if args.size else args.model,
        "size": args.size,
        "params": self.params,
        "timeout_s": args.timeout,
        "seed": args.seed,
        "network": self.network,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": self.load_at_start,
        "started_utc": self.started,
        "versions": versions,
        "command": "python -m experiments.netbench " + " ".join(sys.argv[1:]),
        "step_time": "median over the timed steps of the slowest worker's time",
        "interface_bytes": "tx_bytes of the worker's eth0 over the timed steps, read"
                           " after a line-up of all workers on both ends (so"
                           " every byte sent has crossed the link), per step,"
                           " mean over workers (TCP/IP headers and the line-up"
                           " psums included)",
        **({"link_bytes": report.LINK_BYTES,
            "rows": {m: workload.TWO_LEVEL_ROWS[m] for m in args.methods}}
           if self.mesh_shape else {}),
    }

  def write(self, finished: bool) -> dict:
    summary = (report.two_level_summary(self.runs) if self.mesh_shape
               else report.summary(self.runs, self.args.processes))
    result = {"config": self.config(), "runs": self.runs, "summary": summary,
              "finished": finished,
              "load_average_at_end": list(os.getloadavg())}
    out = self.args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=1)
    return result

  def main(self) -> dict:
    args = self.args
    self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    self.load_at_start = list(os.getloadavg())
    finished = False
    try:
      if self.network["mode"] == "netns":
        self.net = network_lib.Network(
            args.processes, prefix=args.netns_prefix,
            hosts_per_node=args.local_size if self.mesh_shape else None)
        self.net.up()
        self.net.shape(args.bandwidths[0])
        measured = self.net.one_way_latency_us()
        self.network.update({
            "links": self._links(),
            "measured_one_way_latency_us": measured,
            "added_latency_us": args.latency_us,
            "model_latency_us": measured + args.latency_us,
        })
        bandwidths = args.bandwidths + ([None] if self.mesh_shape else [])
      else:
        bandwidths = [None]
      for method in args.methods:
        where = ", ".join(("unshaped" if self.net else "loopback") if b is None
                          else f"{b:g} Gbit/s" for b in bandwidths)
        print(f"netbench: {method} at {where} ...", flush=True)
        rows = self.run_method(method, bandwidths)
        self.runs.extend(rows)
        for row in rows:
          print("  " + report.one_line(row), flush=True)
        self.write(finished=False)
      finished = True
    finally:
      _kill(list(_active))
      if self.net is not None:
        self.net.down()
      result = self.write(finished)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, _stop)
  bench = Bench(args)
  try:
    result = bench.main()
  except (KeyboardInterrupt, Stopped) as e:
    print(f"netbench: stopped ({type(e).__name__} {e}); network removed,"
          f" partial results in {args.out}", file=sys.stderr)
    return 130
  if not args.no_report:
    stem = os.path.splitext(args.out)[0]
    report.write_markdown(result, stem + ".md")
    report.write_plot(result, stem + ".png")
  ok = all(r["status"] in ("ok", "unavailable") for r in result["runs"])
  return 0 if ok else 1
