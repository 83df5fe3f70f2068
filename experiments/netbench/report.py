"""The netbench results as a summary of the goals, a markdown table and a plot."""

from __future__ import annotations

from typing import Optional

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


def ring_bound_s(params: int, processes: int, bandwidth_gbit: float) -> float:
  """Seconds of a ring all-reduce of ``params`` f32 at the link rate: ``2(P-1)/P * 4n / B``."""
  return 2 * (processes - 1) / processes * 4 * params / (bandwidth_gbit * 1e9 / 8)


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
  pred = row.get("predicted_step_s")
  return (f"step {_ms(row['step_time_s'])} ms, compute {_ms(row['compute_s'])} ms,"
          f" HLO {_mb(row['comm_bytes'])} MB, interface {_mb(row['interface_bytes'])} MB,"
          f" predicted {_ms(pred) or '-'} ms")


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
  ]
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


def write_markdown(result: dict, path: str) -> None:
  with open(path, "w") as f:
    f.write(markdown(result))


def write_plot(result: dict, path: str) -> None:
  """Step time per method, one bar per bandwidth, log scale."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in result["runs"] if r["status"] == "ok"]
  methods = list(dict.fromkeys(r["method"] for r in rows))
  bandwidths = list(dict.fromkeys(r["bandwidth_gbit"] for r in rows))
  fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(methods) + 2), 4))
  width = 0.8 / max(1, len(bandwidths))
  for j, bandwidth in enumerate(bandwidths):
    by_method = {r["method"]: r for r in rows if r["bandwidth_gbit"] == bandwidth}
    xs = [i + (j - (len(bandwidths) - 1) / 2) * width for i, m in enumerate(methods)
          if m in by_method]
    ys = [by_method[m]["step_time_s"] * 1e3 for m in methods if m in by_method]
    label = "loopback" if bandwidth is None else f"{bandwidth:g} Gbit/s"
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
  config = result["config"]
  ax.set_title(f"One gradient exchange step, P={config['processes']},"
               f" {config['params'] / 1e6:.1f}M floats ({config['network']['mode']})")
  if rows:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
