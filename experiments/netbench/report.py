"""The netbench results as a summary of the goals, a markdown table and a plot."""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

# The goals at 1 Gbit/s: (name, numerator method, denominator method, bound).
# A speedup is the denominator's step time over the numerator's.
_SPEEDUPS = (
    ("gtopk_over_allreduce", "gtopk", "allreduce", 5.0),
    ("acpsgd_over_allreduce", "acpsgd", "allreduce", 3.0),
    ("acpsgd_over_powersgd", "acpsgd", "powersgd", 1.4),
    ("powersgd_over_torch_powersgd", "powersgd", "torch_powersgd", 1.0),
)
_PREDICTION_BOUND = 1.5
_RING_BOUND = 1.3

# Two levels, the goals at 1 Gbit/s between nodes (same shape as above).
_TWO_LEVEL_SPEEDUPS = (
    ("hierarchical_gtopk_over_gtopk", "hierarchical_gtopk", "gtopk", 1.5),
    ("hierarchical_gtopk_over_allreduce_ring", "hierarchical_gtopk", "allreduce_ring", 5.0),
)
_TWO_LEVEL_GOAL_GBIT = 1.0
LINK_BYTES = (
    "per step per device, between nodes (slow) and inside a node (fast). Program and"
    " formula: the compiled step's bytes by mesh axes (jaxcomp.wire.collective_bytes and"
    " expected_bytes, by_axes): a collective over the slow axis alone crosses nodes, over"
    " the fast axis alone stays inside one, over both (the flat ring) runs as a ring over"
    " the P processes in order, `nodes` of whose P hops cross. Counters: the uplinks'"
    " tx_bytes (between nodes) and the workers' eth0 tx_bytes less those (inside nodes)"
    " over the timed steps, divided by the steps and the processes (TCP/IP headers and"
    " the line-up psums included)")


def ring_bound_s(params: int, processes: int, bandwidth_gbit: float) -> float:
  """Seconds of a ring all-reduce of ``params`` f32 at the link rate: ``2(P-1)/P * 4n / B``."""
  return 2 * (processes - 1) / processes * 4 * params / (bandwidth_gbit * 1e9 / 8)


def axes_link_bytes(by_axes: Mapping[str, float], mesh_shape: Mapping[str, int]
                    ) -> dict[str, float]:
  """Bytes per device between nodes (``slow``) and inside them (``fast``), from bytes by axes.

  ``by_axes`` is keyed by ``"+"``-joined axis names; ``mesh_shape`` is
  ``{slow: nodes, fast: L}``. See :data:`LINK_BYTES`.
  """
  slow_axis, fast_axis = tuple(mesh_shape)
  crossing = mesh_shape[slow_axis] / math.prod(mesh_shape.values())
  slow = fast = 0.0
  for key, nbytes in by_axes.items():
    axes = key.split("+")
    share = (crossing if fast_axis in axes else 1.0) if slow_axis in axes else 0.0
    slow += share * nbytes
    fast += (1 - share) * nbytes
  return {"slow": slow, "fast": fast}


def counter_link_bytes(sent: Sequence[int], uplink_sent: int, steps: int) -> dict[str, float]:
  """Per step per device: bytes between nodes and inside them, from interface counters.

  Args:
    sent: each worker's ``eth0`` tx bytes over the timed steps.
    uplink_sent: the node uplinks' tx bytes over the same steps (every byte
      between nodes leaves its node once, through its uplink).
    steps: the timed steps.
  """
  per = steps * len(sent)
  return {"slow": uplink_sent / per, "fast": (sum(sent) - uplink_sent) / per}


def _ok(runs, bandwidth):
  return {r["method"]: r for r in runs
          if r["bandwidth_gbit"] == bandwidth and r["status"] == "ok"}


def summary(runs: list[dict], processes: int) -> dict:
  """Per bandwidth: the goals' ratios (``None`` where a row is missing)."""
  out = {}
  for bandwidth in sorted({r["bandwidth_gbit"] for r in runs if r["bandwidth_gbit"]}):
    rows = _ok(runs, bandwidth)
    goals = {}
    for name, fast, slow, bound in _SPEEDUPS:
      if fast in rows and slow in rows:
        speedup = rows[slow]["step_time_s"] / rows[fast]["step_time_s"]
        goals[name] = {"speedup": speedup, "goal": bound, "met": speedup >= bound}
      else:
        goals[name] = None
    for method in ("allreduce", "torch_allreduce"):
      if method in rows:
        bound = ring_bound_s(rows[method]["params"], processes, bandwidth)
        ratio = rows[method]["exchange_s"] / bound
        goals[f"{method}_exchange_over_ring_bound"] = {
            "exchange_s": rows[method]["exchange_s"], "ring_bound_s": bound,
            "ratio": ratio, "goal": _RING_BOUND, "met": ratio <= _RING_BOUND}
    ratios = {m: r["predicted_over_measured"] for m, r in rows.items()
              if r.get("predicted_over_measured") is not None}
    outside = sorted(m for m, x in ratios.items()
                     if not 1 / _PREDICTION_BOUND <= x <= _PREDICTION_BOUND)
    goals["prediction_within_1.5x"] = {
        "predicted_over_measured": ratios, "outside": outside, "met": not outside}
    out[f"{bandwidth:g}"] = goals
  return out


def bandwidth_key(bandwidth: Optional[float]) -> str:
  """A bandwidth as the results name it: ``"1"``, ``"10"``, ``"unshaped"`` (``None``)."""
  return "unshaped" if bandwidth is None else f"{bandwidth:g}"


def uplink_bound_s(row: dict, local: int) -> Optional[float]:
  """Seconds the bytes leaving a node take through its shaped uplink (``None`` unshaped).

  ``L`` processes' bytes between nodes (counted on the interfaces, headers
  included, where measured; else the program's) at the row's rate.
  """
  links = row.get("link_bytes", {})
  slow = links.get("counters", links.get("program", {})).get("slow")
  if row["bandwidth_gbit"] is None or slow is None:
    return None
  return local * slow / (row["bandwidth_gbit"] * 1e9 / 8)


def two_level_summary(runs: list[dict]) -> dict:
  """Per bandwidth between nodes (and ``"unshaped"``): hierarchical gTop-k's speedups.

  Each is the other row's step time over ``hierarchical_gtopk``'s, from the
  same run; at 1 Gbit/s with the issue's goal and whether it is met. The
  ceiling is the speedup were its step as short as its unshaped one.
  """
  out = {}
  bandwidths = sorted({r["bandwidth_gbit"] for r in runs if r["bandwidth_gbit"]})
  for bandwidth in bandwidths + [None]:
    rows = _ok(runs, bandwidth)
    goals = {}
    for name, fast, slow, bound in _TWO_LEVEL_SPEEDUPS:
      if fast not in rows or slow not in rows:
        goals[name] = None
        continue
      speedup = rows[slow]["step_time_s"] / rows[fast]["step_time_s"]
      goals[name] = {"speedup": speedup}
      if bandwidth is not None and rows[fast].get("unshaped_step_s"):
        goals[name]["ceiling"] = rows[slow]["step_time_s"] / rows[fast]["unshaped_step_s"]
      if bandwidth == _TWO_LEVEL_GOAL_GBIT:
        goals[name].update(goal=bound, met=speedup >= bound)
    out[bandwidth_key(bandwidth)] = goals
  return out


def _ms(x: Optional[float]) -> str:
  return "" if x is None else f"{x * 1e3:,.1f}"


def _mb(x: Optional[float]) -> str:
  return "" if x is None else f"{x / 1e6:,.3f}"


def _why(row: dict) -> str:
  """The line of a row's error that says what went wrong."""
  lines = [x for x in str(row.get("error", "")).strip().splitlines() if x.strip()]
  named = [x for x in lines if "Error" in x or "error" in x]
  return (named or lines or [""])[-1].strip()


def one_line(row: dict) -> str:
  if row["status"] != "ok":
    return f"{row['status']}: {_why(row)}"
  if "link_bytes" in row:
    counters = row["link_bytes"].get("counters", {})
    return (f"step {_ms(row['step_time_s'])} ms, HLO {_mb(row['comm_bytes'])} MB,"
            f" between nodes {_mb(counters.get('slow'))} MB, inside"
            f" {_mb(counters.get('fast'))} MB (counters)")
  pred = row.get("predicted_step_s")
  training = (f"; training step {_ms(row['train_step_s'])} ms, its compute"
              f" {_ms(row['train_compute_s'])} ms, hidden {_ms(row['hidden_s'])} ms"
              if "train_step_s" in row else "")
  return (f"step {_ms(row['step_time_s'])} ms, compute {_ms(row['compute_s'])} ms,"
          f" HLO {_mb(row['comm_bytes'])} MB, interface {_mb(row['interface_bytes'])} MB,"
          f" predicted {_ms(pred) or '-'} ms{training}")


def _stopped(result: dict) -> list[str]:
  """A paragraph naming the methods without rows when the run stopped before its end
  (``finished`` false: a signal or a time-out), else nothing."""
  if result.get("finished", True):
    return []
  ran = {row["method"] for row in result["runs"]}
  missing = [m for m in result["config"].get("methods", []) if m not in ran]
  rest = f"no rows for {', '.join(missing)}" if missing else "every method has its rows"
  return [f"**The run stopped before its end** (`finished` is false): {rest}.", ""]


def markdown(result: dict) -> str:
  config = result["config"]
  net = config["network"]
  lines = [
      "# netbench: one gradient exchange step over an emulated network",
      "",
      f"{config['processes']} worker processes, one CPU device each, gloo;"
      f" {config['params']:,} f32 gradient elements"
      f" ({config['model'] or 'stand-in of --size'}); {config['steps']} timed steps"
      f" after {config['warmup']} warm-up steps; {config['cpu_count']} CPU cores;"
      f" load average at start {config['load_average_at_start'][0]:.2f},"
      f" at end {result['load_average_at_end'][0]:.2f}.",
      "",
  ] + _stopped(result)
  if net["mode"] == "netns":
    lines += [
        f"Network: {net['links']}; measured one-way latency"
        f" {net['measured_one_way_latency_us']:.1f} us, added"
        f" {net['added_latency_us']:g} us; the cost model uses"
        f" {net['model_latency_us']:.1f} us.",
        "",
    ]
  else:
    lines += [f"**Network: loopback, no shaping ({net['fallback_reason']}).**", ""]
  lines += [
      "Step: median over the timed steps of the slowest worker. Compute: the same"
      " update on one device, all workers at once. Exchange: step minus compute."
      " HLO bytes: `jaxcomp.wire.collective_bytes` of the compiled step, per device."
      " Interface bytes: the worker's `eth0` tx counter per step. Torch rows: a DDP"
      " forward+backward whose backward writes the gradient into one bucket; their"
      " compute is the same step of DDP over a gloo group of one (hook included);"
      " predicted as the jaxcomp method that sends the same bytes.",
      "",
      "| Gbit/s | method | step ms | compute ms | exchange ms | HLO MB | interface MB"
      " | predicted ms | pred/meas | vs allreduce | outputs identical |",
      "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for row in result["runs"]:
    bandwidth = "loopback" if row["bandwidth_gbit"] is None else f"{row['bandwidth_gbit']:g}"
    if row["status"] != "ok":
      lines.append(f"| {bandwidth} | {row['method']} | {row['status']} | | | | | | | | |")
      continue
    dense = _ok(result["runs"], row["bandwidth_gbit"]).get("allreduce")
    speedup = f"{dense['step_time_s'] / row['step_time_s']:.2f}x" if dense else ""
    ratio = row.get("predicted_over_measured")
    lines.append(
        f"| {bandwidth} | {row['method']} | {_ms(row['step_time_s'])} | {_ms(row['compute_s'])}"
        f" | {_ms(row['exchange_s'])} | {_mb(row['comm_bytes'])} | {_mb(row['interface_bytes'])}"
        f" | {_ms(row.get('predicted_step_s'))} | {'' if ratio is None else f'{ratio:.2f}'}"
        f" | {speedup} | {row['outputs_identical']} |")
  if config.get("pipelined"):
    lines += pipelined_table(result["runs"])
  failures = [r for r in result["runs"] if r["status"] not in ("ok",)]
  if failures:
    lines += ["", "Rows that did not run:", ""]
    for row in failures:
      lines.append(f"- {row['method']} at {row['bandwidth_gbit']}: {row['status']}:"
                   f" {_why(row)}")
  for bandwidth, goals in result["summary"].items():
    lines += ["", f"## Goals at {bandwidth} Gbit/s", ""]
    for name, goal in goals.items():
      if goal is None:
        lines.append(f"- {name}: not measured (a row is missing)")
      elif "speedup" in goal:
        lines.append(f"- {name}: {goal['speedup']:.2f}x (goal {goal['goal']:g}x):"
                     f" {'met' if goal['met'] else 'NOT met'}")
      elif "ring_bound_s" in goal:
        lines.append(f"- {name}: exchange {_ms(goal['exchange_s'])} ms, ring bound"
                     f" {_ms(goal['ring_bound_s'])} ms, {goal['ratio']:.2f}x (goal <="
                     f" {goal['goal']:g}x): {'met' if goal['met'] else 'NOT met'}")
      else:
        lines.append(f"- {name}: {'met' if goal['met'] else 'NOT met'}; outside:"
                     f" {', '.join(goal['outside']) or 'none'}")
  return "\n".join(lines) + "\n"


def pipelined_table(runs: list[dict]) -> list[str]:
  """The pipelined rows: a whole training step against its compute plus the exchange."""
  lines = [
      "", "## Pipelined: a whole training step", "",
      "Training step: forward, backward, exchange and SGD of a chain of layers shaped like"
      " the gradient (`workload.chain_loss`), median of the slowest worker. Its compute:"
      " the same step on one device, all workers at once. Exchange: the update alone's"
      " step minus its compute (the table above). Hidden: compute + exchange - training"
      " step; above zero, part of the exchange ran while the step computed (XLA"
      " overlapped it with the backward pass).",
      "",
      "| Gbit/s | method | buckets | training step ms | its compute ms | exchange ms"
      " | compute + exchange ms | hidden ms | step / (compute + exchange) |",
      "|---:|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for row in runs:
    if row["status"] != "ok" or "train_step_s" not in row:
      continue
    bandwidth = "loopback" if row["bandwidth_gbit"] is None else f"{row['bandwidth_gbit']:g}"
    cap = row["config"].get("bucket_cap_mb")
    lines.append(
        f"| {bandwidth} | {row['method']} | {'one' if cap is None else f'{cap:g} MiB'}"
        f" | {_ms(row['train_step_s'])} | {_ms(row['train_compute_s'])}"
        f" | {_ms(row['exchange_s'])} | {_ms(row['serial_s'])} | {_ms(row['hidden_s'])}"
        f" | {row['train_step_s'] / row['serial_s']:.2f} |")
  return lines


def _speedup(rows: dict, row: dict, over: str) -> str:
  other = rows.get(over)
  return f"{other['step_time_s'] / row['step_time_s']:.2f}x" if other else ""


def _capped(uplink_s: Optional[float], unshaped_s: Optional[float]) -> str:
  """The larger bound on a step: ``link`` (the uplink's time) or ``cores`` (the unshaped step)."""
  if uplink_s is None or unshaped_s is None:
    return ""
  return "link" if uplink_s > unshaped_s else "cores"


def _two_level_row(row: dict, rows: dict, local: int) -> str:
  links = row.get("link_bytes", {})
  cells = [_mb(links.get(source, {}).get(side))
           for side in ("slow", "fast") for source in ("program", "formula", "counters")]
  unshaped = row.get("unshaped_step_s")
  uplink = uplink_bound_s(row, local)
  return (f"| {bandwidth_key(row['bandwidth_gbit'])} | {row['method']}"
          f" | {_ms(row['step_time_s'])} | {_ms(unshaped)} | {_ms(uplink)}"
          f" | {_capped(uplink, unshaped)}"
          f" | {_speedup(rows, row, 'gtopk')} | {_speedup(rows, row, 'allreduce_ring')}"
          f" | {' | '.join(cells)} | {row.get('outputs_identical', '')} |")


def _axes_table(runs: list[dict]) -> list[str]:
  """Bytes per device by mesh axes, program and formula, once per row."""
  lines = ["| row | program: node | local | node+local | formula: node | local | node+local"
           " | equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
  seen = set()
  for row in runs:
    if row["status"] != "ok" or row["method"] in seen or "comm_bytes_by_axes" not in row:
      continue
    seen.add(row["method"])
    program, formula = row["comm_bytes_by_axes"], row["expected_bytes_by_axes"]
    cells = [_mb(by.get(key)) for by in (program, formula)
             for key in ("node", "local", "node+local")]
    lines.append(f"| {row['method']} | {' | '.join(cells)} | {program == formula} |")
  return lines


def two_level_markdown(result: dict) -> str:
  """The two-level table: step times, speedups, bytes between and inside nodes."""
  config = result["config"]
  net = config["network"]
  shape = config["mesh_shape"]
  local = tuple(shape.values())[1]
  lines = [
      "# netbench, two levels: one gradient exchange step, nodes joined by shaped links",
      "",
      f"{config['processes']} worker processes, one CPU device each, gloo; mesh"
      f" {tuple(shape.values())} with axes {tuple(shape)} (slow, fast), processes"
      f" 0..{local - 1} on node 0; {config['params']:,} f32 gradient elements"
      f" ({config['model'] or 'stand-in of --size'}); {config['steps']} timed steps after"
      f" {config['warmup']} warm-up steps (compiled before, not timed);"
      f" {config['cpu_count']} CPU cores; load average at start"
      f" {config['load_average_at_start'][0]:.2f}, at end"
      f" {result['load_average_at_end'][0]:.2f}.",
      "",
  ] + _stopped(result)
  if net["mode"] == "netns":
    lines += [f"Network: {net['links']}; measured one-way latency between nodes"
              f" {net['measured_one_way_latency_us']:.1f} us (unshaped inside a node).", ""]
  else:
    lines += [f"**Network: loopback, no shaping ({net['fallback_reason']}).**", ""]
  lines += [
      "Step: median over the timed steps of the slowest worker. Unshaped: the same step"
      " with every link unshaped (the compute, and the bytes copied through the kernel on"
      " the machine's cores: the step's floor here). Uplink: the time the bytes leaving a"
      f" node (its {local} processes' slow bytes, counters) take at the shaped rate. Capped"
      " by: the larger of the two, `cores` (unshaped) or `link` (uplink). vs gtopk, vs"
      " ring: the flat `gtopk` (or `allreduce_ring`) row's step over this row's, same run"
      f" and bandwidth. MB: {LINK_BYTES}.",
      "",
      "| Gbit/s between nodes | row | step ms | unshaped ms | uplink ms | capped by"
      " | vs gtopk | vs ring | slow MB program | slow MB formula | slow MB counters"
      " | fast MB program | fast MB formula | fast MB counters | outputs identical |",
      "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  runs = result["runs"]
  for row in runs:
    if row["status"] != "ok":
      lines.append(f"| {bandwidth_key(row['bandwidth_gbit'])} | {row['method']}"
                   f" | {row['status']} |{' |' * 12}")
      continue
    lines.append(_two_level_row(row, _ok(runs, row["bandwidth_gbit"]), local))
  lines += ["", "Bytes per device per step by the mesh axes each collective spans, MB:", ""]
  lines += _axes_table(runs)
  lines += ["", "Rows:", ""]
  lines += [f"- `{name}`: {what}" for name, what in config["rows"].items()]
  failures = [r for r in runs if r["status"] != "ok"]
  if failures:
    lines += ["", "Rows that did not run:", ""]
    lines += [f"- {r['method']} at {bandwidth_key(r['bandwidth_gbit'])}: {r['status']}:"
              f" {_why(r)}" for r in failures]
  for bandwidth, goals in result["summary"].items():
    lines += ["", f"## hierarchical_gtopk at {bandwidth}"
              + ("" if bandwidth == "unshaped" else " Gbit/s between nodes"), ""]
    for name, goal in goals.items():
      if goal is None:
        lines.append(f"- {name}: not measured (a row is missing)")
        continue
      verdict = (f" (goal {goal['goal']:g}x): {'met' if goal['met'] else 'NOT met'}"
                 if "goal" in goal else "")
      ceiling = (f"; at most {goal['ceiling']:.2f}x were its step as short as unshaped"
                 if "ceiling" in goal else "")
      lines.append(f"- {name}: {goal['speedup']:.2f}x{verdict}{ceiling}")
  return "\n".join(lines) + "\n"


def write_markdown(result: dict, path: str) -> None:
  with open(path, "w") as f:
    f.write(two_level_markdown(result) if result["config"].get("mesh_shape") else markdown(result))


def write_plot(result: dict, path: str) -> None:
  """Step time per method, one bar per bandwidth, log scale."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in result["runs"] if r["status"] == "ok"]
  methods = list(dict.fromkeys(r["method"] for r in rows))
  bandwidths = list(dict.fromkeys(r["bandwidth_gbit"] for r in rows))
  config = result["config"]
  fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(methods) + 2), 4))
  width = 0.8 / max(1, len(bandwidths))
  for j, bandwidth in enumerate(bandwidths):
    by_method = {r["method"]: r for r in rows if r["bandwidth_gbit"] == bandwidth}
    xs = [i + (j - (len(bandwidths) - 1) / 2) * width for i, m in enumerate(methods)
          if m in by_method]
    ys = [by_method[m]["step_time_s"] * 1e3 for m in methods if m in by_method]
    label = (("unshaped" if config["network"]["mode"] == "netns" else "loopback")
             if bandwidth is None else f"{bandwidth:g} Gbit/s")
    ax.bar(xs, ys, width, label=label)
    preds = [(x, by_method[m].get("predicted_step_s")) for x, m in
             zip(xs, [m for m in methods if m in by_method])]
    preds = [(x, p * 1e3) for x, p in preds if p is not None]
    if preds:
      ax.scatter(*zip(*preds), marker="_", s=200, color="black", zorder=3,
                 label="predicted" if j == 0 else None)
  ax.set_xticks(range(len(methods)))
  ax.set_xticklabels(methods, rotation=30, ha="right")
  ax.set_yscale("log")
  ax.set_ylabel("step time (ms, median)")
  levels = f", mesh {tuple(config['mesh_shape'].values())}" if config.get("mesh_shape") else ""
  ax.set_title(f"One gradient exchange step, P={config['processes']}{levels},"
               f" {config['params'] / 1e6:.1f}M floats ({config['network']['mode']})")
  if rows:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
