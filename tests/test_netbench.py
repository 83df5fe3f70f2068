"""netbench: the launcher end to end (P = 2, loopback), the network namespaces when root."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from experiments.netbench import launcher
from experiments.netbench import network
from experiments.netbench import report

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
needs_netns = pytest.mark.skipif(
    network.available() is not None,
    reason=f"network namespaces unavailable: {network.available()}")


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
  assert network._ours("jcntbr", "jcnt")
  assert not network._ours("jcnt", "jcnt") and not network._ours("jcntx0", "jcnt")
  assert not network._ours("jcnb0", "jcnt") and not network._ours("eth0", "jcnt")


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
def test_sigterm_kills_workers_and_removes_the_network(tmp_path):
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.netbench", "--netns-prefix", PREFIX,
       "--processes", "2", "--methods", "allreduce", "--bandwidths", "1", "--size", "4096",
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
