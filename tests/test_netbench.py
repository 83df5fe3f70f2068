"""netbench: the launcher end to end (P = 2, loopback), the network namespaces when root."""

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types

import jax
import numpy as np
import pytest

from experiments.netbench import launcher
from experiments.netbench import network
from experiments.netbench import report
from experiments.netbench import workload
from jaxcomp import training
from jaxcomp import wire

REPO_ROOT = launcher.REPO_ROOT
PREFIX = "jcnt"  # not the benchmark's: a test never touches a benchmark's network
SUBNET = "10.213.48"
ROW_KEYS = {
    "method": str, "bandwidth_gbit": (float, type(None)), "processes": int, "params": int,
    "step_time_s": float, "comm_bytes": float, "predicted_step_s": (float, type(None)),
    "interface_bytes": (float, type(None)), "compute_s": float, "exchange_s": float,
    "expected_bytes": float, "step_times_s": list, "outputs_identical": bool,
    "workers": list, "status": str, "config": dict,
}


@pytest.fixture
def one_netns_test_at_a_time():
  """The namespace tests share PREFIX and SUBNET: pytest-xdist's workers take turns."""
  with open(os.path.join(tempfile.gettempdir(), "jaxcomp-netns-tests.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield


def needs_netns(test):
  """Skipped without network namespaces; run by one xdist worker at a time."""
  test = pytest.mark.usefixtures("one_netns_test_at_a_time")(test)
  return pytest.mark.skipif(
      network.available() is not None,
      reason=f"network namespaces unavailable: {network.available()}")(test)


def _bench(tmp_path, *flags, timeout=300):
  env = dict(os.environ, TMPDIR=str(tmp_path))
  return subprocess.run(
      [sys.executable, "-m", "experiments.netbench", *flags], cwd=REPO_ROOT, env=env,
      capture_output=True, text=True, timeout=timeout)


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def _check_row(row, processes):
  assert row["status"] == "ok", row.get("error")
  for key, kind in ROW_KEYS.items():
    assert isinstance(row[key], kind), (key, row[key])
  assert row["processes"] == processes
  assert len(row["step_times_s"]) >= 1
  assert row["outputs_identical"]
  # the compiled step sends what the compressor's formula says
  assert row["comm_bytes"] == row["expected_bytes"]
  assert [w["exit_code"] for w in row["workers"]] == [0] * processes
  assert not any(_alive(w["pid"]) for w in row["workers"])


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("loopback")
  out = tmp / "bench.json"
  done = _bench(tmp, "--no-netns", "--processes", "2", "--methods", "allreduce,cast",
                "--size", "4096", "--steps", "2", "--warmup", "1", "--compute-steps", "1",
                "--timeout", "240", "--out", str(out))
  return done, out


def test_loopback_run_writes_the_schema(loopback):
  done, out = loopback
  assert done.returncode == 0, done.stdout + done.stderr
  assert "loopback, no shaping" in done.stdout
  result = json.loads(out.read_text())
  assert set(result) >= {"config", "runs", "summary"}
  assert result["finished"] is True
  config = result["config"]
  assert config["network"] == {"mode": "loopback", "fallback_reason": "--no-netns given"}
  assert config["processes"] == 2 and config["steps"] == 2
  assert [r["method"] for r in result["runs"]] == ["allreduce", "cast"]
  for row in result["runs"]:
    _check_row(row, 2)
    assert row["bandwidth_gbit"] is None and row["predicted_step_s"] is None
  dense, half = result["runs"]
  n = dense["params"]
  assert dense["comm_bytes"] == 2 * (2 - 1) / 2 * 4 * n
  assert half["comm_bytes"] == dense["comm_bytes"] / 2
  assert "loopback, no shaping" in (out.with_suffix(".md")).read_text()
  assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_loopback_leaves_no_worker_files(loopback):
  done, out = loopback
  assert not list(out.parent.glob("netbench-*"))


@pytest.mark.parametrize("flags, message", [
    (["--methods", "allreduce,nope"], "unknown ['nope']"),
    (["--processes", "1"], "--processes must be >= 2"),
    (["--bandwidths", "0"], "--bandwidths must be positive"),
    (["--size", "10"], "--size must be >= 256"),
])
def test_flags_are_checked(flags, message, capsys):
  with pytest.raises(SystemExit):
    launcher.parse_args(flags)
  assert message in capsys.readouterr().err


def test_summary_states_the_goals():
  def row(method, step, compute, predicted):
    return {"method": method, "bandwidth_gbit": 1.0, "status": "ok", "params": 1_000_000,
            "step_time_s": step, "exchange_s": step - compute,
            "predicted_over_measured": predicted / step}
  runs = [row("allreduce", 0.030, 0.002, 0.030), row("gtopk", 0.005, 0.004, 0.010),
          row("acpsgd", 0.012, 0.004, 0.012), row("powersgd", 0.015, 0.005, 0.015)]
  goals = report.summary(runs, 4)["1"]
  assert goals["gtopk_over_allreduce"]["speedup"] == pytest.approx(6.0)
  assert goals["gtopk_over_allreduce"]["met"]
  assert goals["acpsgd_over_allreduce"]["speedup"] == pytest.approx(2.5)
  assert not goals["acpsgd_over_allreduce"]["met"]
  assert goals["powersgd_over_torch_powersgd"] is None
  ring = goals["allreduce_exchange_over_ring_bound"]
  assert ring["ring_bound_s"] == pytest.approx(2 * 3 / 4 * 4e6 / 125e6)
  assert ring["ratio"] == pytest.approx(0.028 / ring["ring_bound_s"])
  assert goals["prediction_within_1.5x"]["outside"] == ["gtopk"]


def test_only_our_names_are_removed():
  assert network._ours("jcnt0", "jcnt") and network._ours("jcntv12", "jcnt")
  assert network._ours("jcntbr", "jcnt") and network._ours("jcntbr1", "jcnt")
  assert network._ours("jcntu0", "jcnt") and network._ours("jcntc1", "jcnt")
  assert not network._ours("jcnt", "jcnt") and not network._ours("jcntx0", "jcnt")
  assert not network._ours("jcntbrx", "jcnt") and not network._ours("jcntu", "jcnt")
  assert not network._ours("jcnb0", "jcnt") and not network._ours("eth0", "jcnt")


def test_every_name_a_plan_makes_is_removed_by_down():
  layout = network.plan(6, PREFIX, 3)
  names = [*layout.bridges, *(end.device for pair in layout.veths for end in pair
                              if end.namespace is None)]
  assert len(set(names)) == len(names) and all(network._ours(n, PREFIX) for n in names)
  assert all(len(n) <= 15 for n in names)


# ------------------------------------------------------------- two levels


def _shaped_on(layout, source, target):
  return [end for end in network.route(layout, f"{PREFIX}{source}", f"{PREFIX}{target}")
          if end in layout.shaped]


def test_one_level_plan_shapes_every_host_link_both_ways():
  layout = network.plan(4, PREFIX)
  assert layout.uplinks == ()
  for source in range(4):
    for target in range(4):
      if source != target:
        shaped = _shaped_on(layout, source, target)
        # the sender's NIC, then the receiver's: each host link shaped each way
        assert [e.device for e in shaped] == ["eth0", f"{PREFIX}v{target}"]
        assert shaped[0].namespace == f"{PREFIX}{source}"


@pytest.mark.parametrize("hosts, per_node", [(4, 2), (6, 2), (6, 3)])
def test_two_level_plan_shapes_only_the_links_between_nodes(hosts, per_node):
  layout = network.plan(hosts, PREFIX, per_node)
  for source in range(hosts):
    for target in range(hosts):
      if source == target:
        continue
      shaped = _shaped_on(layout, source, target)
      route = network.route(layout, f"{PREFIX}{source}", f"{PREFIX}{target}")
      counted = [end for end in route if end in layout.uplinks]
      delayed = [end for end in route if end in layout.delayed]
      if network.node_of(source, per_node) == network.node_of(target, per_node):
        assert shaped == [] and counted == [] and delayed == []
      else:
        # out of the sender's node and into the receiver's, each shaped once;
        # the byte counts once in the uplinks' tx and gets the latency once
        assert [e.device for e in shaped] == [
            f"{PREFIX}u{network.node_of(source, per_node)}",
            f"{PREFIX}c{network.node_of(target, per_node)}"]
        assert counted == shaped[:1] and delayed == shaped[:1]


@pytest.mark.parametrize("hosts, per_node", [(4, 3), (4, 4), (4, 0)])
def test_two_level_network_needs_whole_nodes(hosts, per_node):
  with pytest.raises(ValueError, match="at least two nodes"):
    network.Network(hosts, prefix=PREFIX, hosts_per_node=per_node)


def test_mesh_puts_processes_of_a_node_on_one_row():
  devices = [types.SimpleNamespace(id=10 + p, process_index=p) for p in range(6)]
  random.Random(0).shuffle(devices)
  shape = {"node": 3, "local": 2}
  mesh = workload.mesh_devices(devices, shape)
  assert mesh.shape == (3, 2)
  for (node, local), device in np.ndenumerate(mesh):
    # the network's node of the process is the mesh's row
    assert network.node_of(device.process_index, 2) == node
    assert device.process_index == 2 * node + local


def _program_and_formula(row, size=4096):
  """Bytes by axes of the compiled two-level step and of the formula, on 4 fake devices."""
  shape = {"node": 2, "local": 2}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), workload.MESH_AXES)
  shapes = workload.gradient_shapes("resnet50", size)
  tx = workload.build(row, shape)
  grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct((4, *s.shape), s.dtype), shapes)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(training.per_device_shape(x.shape, 4),
                                                    x.dtype), jax.eval_shape(tx.init, shapes))
  compiled = training.make_update(tx, mesh, workload.MESH_AXES).lower(grads, state).compile()
  return (wire.collective_bytes(compiled, mesh_shape=shape).by_axes,
          wire.expected_bytes(tx, shapes, shape).by_axes)


def test_flat_ring_and_torus_are_different_programs():
  ring, ring_formula = _program_and_formula("allreduce_ring")
  torus, torus_formula = _program_and_formula("allreduce_torus")
  n = 4096 * 4
  assert ring == ring_formula == {("node", "local"): 2 * 3 / 4 * n}
  # reduce-scatter and all-gather inside a node, the half chunk between nodes
  assert torus == torus_formula == {("local",): n, ("node",): n / 2}


@pytest.mark.parametrize("row", ["gtopk", "hierarchical_gtopk", "hierarchical_gtopk_bf16"])
def test_gtopk_rows_send_by_the_formula(row):
  program, formula = _program_and_formula(row)
  assert program == formula and set(program) == {("node",), ("local",)}
  if row.startswith("hierarchical_gtopk"):  # dense inside a node, sparse between nodes
    assert program[("local",)] > 100 * program[("node",)]


def test_the_bf16_row_halves_the_bytes_inside_a_node_only():
  f32, _ = _program_and_formula("hierarchical_gtopk")
  bf16, _ = _program_and_formula("hierarchical_gtopk_bf16")
  assert bf16[("node",)] == f32[("node",)]
  # the dense reduce-scatter and all-gather halve (2-byte elements); the
  # all-reduce of the int32 skip flag over 2 devices, 2 (2 - 1) / 2 * 4 bytes, stays
  flag = 4.0
  assert bf16[("local",)] - flag == (f32[("local",)] - flag) / 2


def test_link_bytes_from_axes_split_the_flat_ring_by_its_hops():
  shape = {"node": 2, "local": 2}
  assert report.axes_link_bytes({"node+local": 600.0}, shape) == {"slow": 300.0, "fast": 300.0}
  assert report.axes_link_bytes({"local": 400.0, "node": 200.0}, shape) == {
      "slow": 200.0, "fast": 400.0}
  # 4 nodes of 2: 4 of the ring's 8 hops cross nodes
  assert report.axes_link_bytes({"node+local": 800.0}, {"node": 4, "local": 2}) == {
      "slow": 400.0, "fast": 400.0}


def test_link_bytes_from_counters_are_per_step_per_device():
  # 4 workers sent 10, 20, 30, 40 bytes over 2 steps; 60 of them left their node
  assert report.counter_link_bytes([10, 20, 30, 40], 60, 2) == {"slow": 7.5, "fast": 5.0}


def test_uplink_counters_are_read_from_another_namespace_listing():
  listing = (
      "Inter-|   Receive                                                |  Transmit\n"
      " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
      "jcntu0:   13870     207    0    0    0     0          0         0    14114     209"
      "    0    0    0     0       0          0\n"
      "jcntu1:   13828     206    0    0    0     0          0         0    14066     209"
      "    0    0    0     0       0          0\n")
  assert workload.net_dev_tx_bytes(listing, ["jcntu0", "jcntu1"]) == 14114 + 14066
  with pytest.raises(KeyError):
    workload.net_dev_tx_bytes(listing, ["jcntu2"])
  assert workload.uplink_tx_bytes(os.getpid(), []) is None
  assert workload.uplink_tx_bytes(os.getpid(), ["lo"]) >= 0


def _two_level_row(method, bandwidth, step, unshaped, slow_bytes):
  return {"method": method, "bandwidth_gbit": bandwidth, "status": "ok",
          "step_time_s": step, "unshaped_step_s": unshaped,
          "link_bytes": {"counters": {"slow": slow_bytes, "fast": 1e6}}}


def test_uplink_bound_is_a_nodes_bytes_at_the_rate():
  row = _two_level_row("allreduce_ring", 2.0, 1.0, 0.5, 75e6)
  assert report.uplink_bound_s(row, 2) == pytest.approx(2 * 75e6 / 250e6)
  assert report.uplink_bound_s({**row, "bandwidth_gbit": None}, 2) is None


def test_two_level_summary_and_table():
  runs = [_two_level_row("allreduce_ring", 1.0, 1.2, 0.3, 75e6),
          _two_level_row("gtopk", 1.0, 0.6, 0.5, 2e5),
          _two_level_row("hierarchical_gtopk", 1.0, 0.3, 0.24, 1e5),
          _two_level_row("allreduce_ring", 10.0, 0.5, 0.3, 75e6),
          _two_level_row("hierarchical_gtopk", 10.0, 0.25, 0.24, 1e5),
          _two_level_row("hierarchical_gtopk", None, 0.24, 0.24, 1e5)]
  summary = report.two_level_summary(runs)
  assert list(summary) == ["1", "10", "unshaped"]
  at_1 = summary["1"]
  assert at_1["hierarchical_gtopk_over_gtopk"] == {
      "speedup": pytest.approx(2.0), "ceiling": pytest.approx(2.5), "goal": 1.5, "met": True}
  assert at_1["hierarchical_gtopk_over_allreduce_ring"]["speedup"] == pytest.approx(4.0)
  assert not at_1["hierarchical_gtopk_over_allreduce_ring"]["met"]
  # the goals are the at 1 Gbit/s; elsewhere the speedup alone
  assert summary["10"]["hierarchical_gtopk_over_allreduce_ring"] == {
      "speedup": pytest.approx(2.0), "ceiling": pytest.approx(0.5 / 0.24)}
  assert summary["10"]["hierarchical_gtopk_over_gtopk"] is None
  table = report.two_level_markdown({
      "config": {"mesh_shape": {"node": 2, "local": 2}, "processes": 4, "params": 1000,
                 "model": "resnet50", "steps": 10, "warmup": 2, "cpu_count": 2,
                 "load_average_at_start": [1.0], "network": {
                     "mode": "netns", "links": "links", "measured_one_way_latency_us": 12.0},
                 "rows": {"gtopk": "flat"}},
      "runs": runs, "summary": summary, "load_average_at_end": [2.0]})
  lines = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line
           for line in table.splitlines() if line.startswith("| ")}
  # 1.6 ms through the uplink against a 240 ms floor; 1.2 s against 300 ms
  assert " | 1.6 | cores | 2.00x | 4.00x | " in lines["| 1 | hierarchical_gtopk"]
  assert " | 1,200.0 | link | 0.50x | 1.00x | " in lines["| 1 | allreduce_ring"]
  assert ("- hierarchical_gtopk_over_allreduce_ring: 4.00x (goal 5x): NOT met; at most"
          " 5.00x were its step as short as unshaped") in table


@pytest.mark.parametrize("finished, line", [
    (False, "**The run stopped before its end** (`finished` is false): no rows for gtopk,"
            " hierarchical_gtopk."),
    (True, None),
])
def test_a_stopped_run_names_the_methods_without_rows(finished, line):
  runs = [{"method": "allreduce", "bandwidth_gbit": 1.0, "status": "timed out",
           "error": "TimeoutError: the workers did not finish"}]
  flat = {"config": {"processes": 4, "params": 1000, "model": "resnet50", "steps": 10,
                     "warmup": 2, "cpu_count": 16, "load_average_at_start": [1.0],
                     "methods": ["allreduce", "gtopk", "hierarchical_gtopk"],
                     "network": {"mode": "loopback", "fallback_reason": "not root"}},
          "runs": runs, "summary": {}, "load_average_at_end": [2.0], "finished": finished}
  two_level = {**flat, "runs": [_two_level_row("allreduce", 1.0, 1.2, 0.3, 75e6)],
               "config": {**flat["config"], "mesh_shape": {"node": 2, "local": 2},
                          "rows": {}, "network": {"mode": "netns", "links": "links",
                                                  "measured_one_way_latency_us": 12.0}}}
  for table in (report.markdown(flat), report.two_level_markdown(two_level)):
    if line is None:
      assert "stopped" not in table
    else:
      assert line in table.splitlines()


def test_two_level_flags():
  args = launcher.parse_args(["--two-level"])
  assert args.methods == list(workload.TWO_LEVEL_ROWS)
  assert args.out == launcher.DEFAULT_TWO_LEVEL_OUT
  assert launcher.mesh_shape(args) == {"node": 2, "local": 2}
  assert launcher.mesh_shape(launcher.parse_args([])) is None
  assert launcher.parse_args([]).out == launcher.DEFAULT_OUT


@pytest.mark.parametrize("flags, message", [
    (["--two-level", "--local-size", "3"], "into at least two nodes"),
    (["--two-level", "--local-size", "4"], "into at least two nodes"),
    (["--two-level", "--methods", "topk"], "unknown ['topk']"),
])
def test_two_level_flags_are_checked(flags, message, capsys):
  with pytest.raises(SystemExit):
    launcher.parse_args(flags)
  assert message in capsys.readouterr().err


# ------------------------------------------------------------- pipelined rows


def test_pipelined_flags():
  args = launcher.parse_args(["--pipelined"])
  assert args.methods == list(workload.PIPELINED_ROWS)
  assert args.out == launcher.DEFAULT_PIPELINED_OUT
  assert workload.config("gtopk_buckets") == {**workload.config("gtopk"), "bucket_cap_mb": 25.0}
  assert workload.jax_method("acpsgd_buckets") == "acpsgd"


@pytest.mark.parametrize("flags, message", [
    (["--pipelined", "--two-level"], "--pipelined runs on one level"),
    (["--pipelined", "--methods", "topk"], "unknown ['topk']"),
])
def test_pipelined_flags_are_checked(flags, message, capsys):
  with pytest.raises(SystemExit):
    launcher.parse_args(flags)
  assert message in capsys.readouterr().err


def test_the_chain_loss_chains_every_layer_to_the_next():
  """Each layer's output scales the next one's: the first leaf's gradient depends on
  the later leaves (the backward pass reaches it last), the last leaf's on the first
  layer's input."""
  shapes = {"a": jax.ShapeDtypeStruct((4, 3), np.float32),
            "b": jax.ShapeDtypeStruct((3,), np.float32)}
  params = {"a": np.ones((4, 3), np.float32), "b": np.full((3,), 0.5, np.float32)}
  batch = workload.chain_batch(shapes, jax.random.key(0), batch=2)
  assert jax.tree.map(np.shape, batch) == {"a": (2, 4), "b": (2, 1)}
  grads = jax.grad(workload.chain_loss)(params, batch)
  moved = {"a": batch["a"] * 3, "b": batch["b"]}
  again = jax.grad(workload.chain_loss)(params, moved)
  assert not np.allclose(grads["a"], again["a"]) and not np.allclose(grads["b"], again["b"])
  changed_b = {"a": params["a"], "b": params["b"] * 2}
  assert not np.allclose(jax.grad(workload.chain_loss)(changed_b, batch)["a"], grads["a"])


def test_loopback_pipelined_rows_time_the_training_step(tmp_path):
  out = tmp_path / "pipelined.json"
  done = _bench(tmp_path, "--no-netns", "--pipelined", "--processes", "2", "--methods",
                "allreduce_buckets,acpsgd", "--size", "4096", "--steps", "2", "--warmup", "1",
                "--compute-steps", "1", "--timeout", "240", "--out", str(out))
  assert done.returncode == 0, done.stdout + done.stderr
  result = json.loads(out.read_text())
  assert result["config"]["pipelined"] is True
  buckets, acpsgd = result["runs"]
  assert buckets["config"]["bucket_cap_mb"] == 25.0 and "bucket_cap_mb" not in acpsgd["config"]
  for row in result["runs"]:
    _check_row(row, 2)
    assert len(row["train_step_times_s"]) == 2
    assert row["serial_s"] == row["train_compute_s"] + max(row["exchange_s"], 0.0)
    assert row["hidden_s"] == row["serial_s"] - row["train_step_s"]
  table = out.with_suffix(".md").read_text()
  assert "## Pipelined: a whole training step" in table
  assert "| loopback | allreduce_buckets | 25 MiB |" in table
  assert "| loopback | acpsgd | one |" in table


# ------------------------------------------------------------- the torch peer


def test_workers_and_the_torch_peer_see_no_gpu():
  assert launcher.worker_env("eth0")["CUDA_VISIBLE_DEVICES"] == ""
  # the peer hides the GPU itself before torch is imported, whatever it was given
  code = ("import os, sys; import experiments.netbench.torch_peer;"
          " print(repr(os.environ['CUDA_VISIBLE_DEVICES']), 'torch' in sys.modules)")
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=120,
                        env=dict(os.environ, CUDA_VISIBLE_DEVICES="0", JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["''", "False"]


# ------------------------------------------------------------ as root only


@needs_netns
def test_network_up_shape_down():
  net = network.Network(2, prefix=PREFIX, subnet=SUBNET)
  try:
    os.makedirs(os.path.join(network.NETNS_DIR, f"{PREFIX}7"), exist_ok=True)
    subprocess.run(["ip", "netns", "add", f"{PREFIX}7"], check=True)  # a crashed run's
    net.up()
    assert f"{PREFIX}7" not in " ".join(net.leftovers())
    assert set(net.leftovers()) == {
        f"{PREFIX}0", f"{PREFIX}1", f"{PREFIX}br", f"{PREFIX}v0", f"{PREFIX}v1",
        os.path.join(network.NETNS_DIR, f"{PREFIX}0"),
        os.path.join(network.NETNS_DIR, f"{PREFIX}1")}
    with open(os.path.join(network.NETNS_DIR, f"{PREFIX}1", "hosts")) as f:
      assert f"{SUBNET}.2 {socket.gethostname()}" in f.read()
    net.shape(1.0)
    qdiscs = net.qdiscs()
    assert len(qdiscs) == 4 and all("tbf" in q and "rate 1Gbit" in q for q in qdiscs)
    net.shape(10.0)
    assert all("rate 10Gbit" in q for q in net.qdiscs())
    assert net.one_way_latency_us() > 0  # host 0 reaches host 1
  finally:
    net.down()
  assert net.leftovers() == []
  net.down()  # idempotent
  assert net.leftovers() == []


@needs_netns
def test_netns_run_sends_through_the_shaped_links(tmp_path):
  out = tmp_path / "bench.json"
  done = _bench(tmp_path, "--netns-prefix", PREFIX, "--processes", "2", "--methods",
                "allreduce", "--bandwidths", "1", "--size", "262144", "--steps", "2",
                "--warmup", "1", "--compute-steps", "1", "--timeout", "240",
                "--out", str(out), "--no-report")
  assert done.returncode == 0, done.stdout + done.stderr
  result = json.loads(out.read_text())
  assert result["config"]["network"]["mode"] == "netns"
  assert result["config"]["network"]["qdiscs"]["1"][0].startswith("qdisc tbf")
  (row,) = result["runs"]
  _check_row(row, 2)
  assert row["bandwidth_gbit"] == 1.0 and row["predicted_step_s"] > 0
  # every byte the program sends crosses the worker's eth0 (plus headers and
  # the small line-up psum)
  assert row["comm_bytes"] <= row["interface_bytes"] < 1.1 * row["comm_bytes"] + 50_000
  assert network.Network(2, prefix=PREFIX).leftovers() == []


@needs_netns
def test_two_level_network_shapes_only_the_uplinks():
  net = network.Network(4, prefix=PREFIX, subnet=SUBNET, hosts_per_node=2)
  uplinks = [end.device for end in net.plan.uplinks]
  try:
    net.up()
    net.shape(1.0)
    qdiscs = net.qdiscs()
    assert len(qdiscs) == 4 and all("tbf" in q and "rate 1Gbit" in q for q in qdiscs)
    host_ends = [end for pair in net.plan.veths for end in pair if end not in net.plan.shaped]
    assert len(host_ends) == 8 and not any("tbf" in net.qdisc(end) for end in host_ends)
    before = workload.uplink_tx_bytes(os.getpid(), uplinks)
    assert net.one_way_latency_us() > 0  # host 0 reaches host 3, on the other node
    assert workload.uplink_tx_bytes(os.getpid(), uplinks) > before + 200
    net.unshape()
    assert not any("tbf" in q for q in net.qdiscs())
  finally:
    net.down()
  assert net.leftovers() == []


@pytest.mark.slow
@needs_netns
def test_two_level_run_counts_bytes_between_and_inside_nodes(tmp_path):
  out = tmp_path / "bench.json"
  done = _bench(tmp_path, "--two-level", "--netns-prefix", PREFIX, "--methods",
                "allreduce_ring,allreduce_torus", "--bandwidths", "1", "--size", "262144",
                "--steps", "2", "--warmup", "1", "--timeout", "240", "--out", str(out))
  assert done.returncode == 0, done.stdout + done.stderr
  result = json.loads(out.read_text())
  assert result["config"]["mesh_shape"] == {"node": 2, "local": 2}
  runs = result["runs"]
  assert [(r["method"], r["bandwidth_gbit"]) for r in runs] == [
      ("allreduce_ring", 1.0), ("allreduce_ring", None),
      ("allreduce_torus", 1.0), ("allreduce_torus", None)]
  unshaped = {r["method"]: r["step_time_s"] for r in runs if r["bandwidth_gbit"] is None}
  for row in runs:
    assert row["status"] == "ok" and row["outputs_identical"], row.get("error")
    assert row["unshaped_step_s"] == unshaped[row["method"]]
    links = row["link_bytes"]
    assert links["program"] == links["formula"]
    for side in ("slow", "fast"):  # headers and line-ups on top of the program's bytes
      assert links["program"][side] <= links["counters"][side]
      assert links["counters"][side] < 1.1 * links["program"][side] + 50_000
  assert "hierarchical_gtopk" in out.with_suffix(".md").read_text()  # the goals' section
  assert network.Network(4, prefix=PREFIX).leftovers() == []


@needs_netns
@pytest.mark.parametrize("flags", [
    ["--processes", "2", "--methods", "allreduce"],
    pytest.param(["--two-level", "--processes", "2", "--local-size", "1", "--methods",
                  "allreduce_ring"], id="two-level"),
])
def test_sigterm_kills_workers_and_removes_the_network(tmp_path, flags):
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.netbench", "--netns-prefix", PREFIX, *flags,
       "--bandwidths", "1", "--size", "4096",
       "--steps", "100000", "--timeout", "240", "--out", str(tmp_path / "bench.json")],
      cwd=REPO_ROOT, env=dict(os.environ, TMPDIR=str(tmp_path)),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while not _worker_pids(tmp_path) and time.monotonic() < deadline:
      time.sleep(0.5)
    assert _worker_pids(tmp_path), "no worker started"
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, err
  assert "network removed" in err
  assert _worker_pids(tmp_path) == []
  assert network.Network(2, prefix=PREFIX).leftovers() == []
  partial = json.loads((tmp_path / "bench.json").read_text())
  assert partial["finished"] is False


def _worker_pids(tmp_path):
  """Processes whose command line names a spec file under ``tmp_path``."""
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    except OSError:
      continue
    if "experiments.netbench.worker" in cmdline and str(tmp_path) in cmdline:
      pids.append(int(entry))
  return pids
