"""How the compressors scale from 4 to 4096 workers, by the cost model.

  python -m experiments.scaling            # writes scaling.md, scaling.json and PNGs

Nothing is trained: every figure is :mod:`jaxcomp.costmodel`'s alpha-beta
time of the methods' own wire formulas on the gradient shapes of
:mod:`experiments.shapes` (ResNet-50, 25.6M parameters; a BERT-base-sized
transformer, 109M). Three tables, each beside the seed figure it is compared
with:

1. gTop-k against Top-k and dense S-SGD on 1 Gbit/s Ethernet: the exchange
   grows as ``O(k log P)``, ``O(k P)`` and ``O(n)``; the scaling efficiency
   (compute over compute plus exchange) at 32 workers is compared with the
   gTop-k paper's 2.7-12x over S-SGD and 1.1-1.7x over Top-k.
2. ACP-SGD against PowerSGD: bytes per step (about half) and the predicted
   step at 1 to 100 Gbit/s, compared with the ACP-SGD paper's 4.06x over
   S-SGD and 1.43x over PowerSGD (averages).
3. The 2D torus against the flat ring for the dense fp16 all-reduce on a
   fast network: the latency term grows with ``rows + cols`` instead of P,
   compared with Mikami et al.'s 84.75% scaling efficiency at 1024 GPUs.
4. Two levels: nodes of 8 devices (NVLink-class links inside, 1 to 100
   Gbit/s between), 4 to 512 nodes; each method flat, on the 2D torus and
   hierarchical (:func:`jaxcomp.hierarchical`: compressed on the slow links
   only), and what :func:`jaxcomp.costmodel.recommend` picks.
5. DiLoCo on the transformer, nodes of 8: synchronous data parallelism
   (dense and int8 through :func:`jaxcomp.hierarchical`) against DiLoCo
   (dense, int4 and SparseLoCo outer gradients every 30 steps), per inner
   step (:func:`jaxcomp.costmodel.predict_diloco`).

The per-step computation is *given*, not measured (``--compute-s``: forward
and backward of one worker, a GPU figure), and the compression computation
is :data:`experiments.compute.NS_PER_ELEMENT` (measured on 2 CPU cores, so
pessimistic for a GPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from experiments import compute
from experiments import shapes
from jaxcomp import costmodel
from jaxcomp import registry

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
WORKERS = tuple(2 ** e for e in range(2, 13))  # 4 .. 4096
MODELS = {"resnet50": shapes.resnet50, "transformer": shapes.transformer}


def _mesh(p: int) -> tuple[int, int]:
  """The squarest power-of-two ``rows x cols`` mesh of ``p`` devices."""
  rows = 1 << ((p.bit_length() - 1) // 2)
  return rows, p // rows


def _seconds(name: str, params, p, bandwidth, latency, config=None, compute_s=0.0,
             with_compression=True) -> dict:
  cost = registry.wire_cost(name, params, p, **(config or {}))
  n = shapes.num_params(params)
  compression = compute.compression_s(name, n) if with_compression else 0.0
  exchange = costmodel.exchange_time(cost, bandwidth, latency)
  latency_part = exchange - costmodel.exchange_time(cost, bandwidth, 0.0)
  step = compute_s + compression + exchange
  return {
      "bytes": float(sum(t.bytes * t.weight for t in cost)),
      "exchange_s": exchange,
      "latency_s": latency_part,
      "compression_s": compression,
      "step_s": step,
      "efficiency": compute_s / step if compute_s else None,
  }


def sparse_table(args) -> dict:
  """gTop-k, Top-k and dense S-SGD over P at 1 Gbit/s."""
  out = {}
  for model in ("resnet50", "transformer"):
    params = MODELS[model]()
    compute_s = args.compute_s[model]
    rows = {}
    for p in WORKERS:
      rows[p] = {
          name: _seconds(name, params, p, args.ethernet_gbit, args.ethernet_latency_us,
                         {"density": args.density} if name != "allreduce" else None,
                         compute_s)
          for name in ("allreduce", "topk", "gtopk")
      }
    out[model] = rows
  return out


def lowrank_table(args) -> dict:
  """PowerSGD and ACP-SGD at rank 4, P = 32, from 1 to 100 Gbit/s."""
  out = {}
  for model in ("resnet50", "transformer"):
    params = MODELS[model]()
    compute_s = args.compute_s[model]
    rows = {}
    for bandwidth in (1.0, 10.0, 100.0):
      latency = args.ethernet_latency_us if bandwidth < 100 else args.fast_latency_us
      rows[bandwidth] = {
          name: _seconds(name, params, args.lowrank_workers, bandwidth, latency,
                         {"rank": args.rank} if name != "allreduce" else None, compute_s)
          for name in ("allreduce", "powersgd", "acpsgd")
      }
    out[model] = rows
  return out


def torus_table(args) -> dict:
  """The fp16 dense all-reduce of ResNet-50, flat ring against 2D torus."""
  params = MODELS["resnet50"]()
  rows = {}
  for p in WORKERS:
    flat = _seconds("cast", params, p, args.fast_gbit, args.fast_latency_us,
                    {"dtype": "float16"}, args.torus_compute_s, with_compression=False)
    torus = _seconds("cast", params, _mesh(p), args.fast_gbit, args.fast_latency_us,
                     {"dtype": "float16"}, args.torus_compute_s, with_compression=False)
    rows[p] = {"mesh": "x".join(map(str, _mesh(p))), "flat": flat, "torus": torus}
  return rows


NODES = tuple(2 ** e for e in range(2, 10))  # 4 .. 512
TWO_LEVEL_METHODS = ("allreduce", "gtopk", "dgc", "powersgd", "acpsgd")
TWO_LEVEL_COLUMNS = (("allreduce", "flat"), ("allreduce", "torus"), ("gtopk", "flat"),
                     ("gtopk", "hierarchical"), ("dgc", "hierarchical"),
                     ("powersgd", "hierarchical"), ("acpsgd", "hierarchical"))


def two_level_table(args) -> dict:
  """ResNet-50 on nodes of ``--node-size`` devices: every method in every layout."""
  params = MODELS["resnet50"]()
  n = shapes.num_params(params)
  compression = {name: compute.compression_s(name, n) for name in TWO_LEVEL_METHODS}
  configs = {"gtopk": {"density": args.density}, "dgc": {"density": args.density},
             "powersgd": {"rank": args.rank}, "acpsgd": {"rank": args.rank}}
  out = {}
  for bandwidth in (1.0, 10.0, 100.0):
    latency = args.ethernet_latency_us if bandwidth < 100 else args.fast_latency_us
    rows = {}
    for nodes in NODES:
      ranked = costmodel.recommend(
          params, {"dcn": nodes, "ici": args.node_size},
          {"dcn": bandwidth, "ici": args.node_gbit},
          {"dcn": latency, "ici": args.node_latency_us},
          methods=TWO_LEVEL_METHODS, configs=configs, compute_s=compression,
          base_compute_s=args.compute_s["resnet50"])
      rows[nodes] = {"steps_s": {f"{r.name}/{r.layout}": r.seconds for r in ranked},
                     "best": f"{ranked[0].name}/{ranked[0].layout}"}
    out[bandwidth] = rows
  return out


DILOCO_NODES = (4, 16, 64, 256)
DILOCO_SYNC_PERIOD = 30
# (label, mode, compressor, its arguments): "sync" exchanges every step through
# jaxcomp.hierarchical, "diloco" every DILOCO_SYNC_PERIOD steps.
DILOCO_COLUMNS = (
    ("sync dense", "sync", "allreduce", {}),
    ("sync int8", "sync", "quantized", {"bits": 8}),
    ("DiLoCo dense", "diloco", "allreduce", {}),
    ("DiLoCo int4", "diloco", "quantized", {"bits": 4}),
    ("DiLoCo SparseLoCo", "diloco", "sparseloco", {"density": 1 / 64}),
)


def diloco_table(args) -> dict:
  """The transformer on nodes of ``--node-size``: synchronous against DiLoCo, per inner step.

  The inner step exchanges densely inside a node every step; a DiLoCo sync
  costs its outer compressor's formula once every H steps
  (:func:`jaxcomp.costmodel.predict_diloco`), its compression compute on each
  device's 1/8 shard once every H steps too.
  """
  import jaxcomp
  from jaxcomp import training
  from jaxcomp import wire

  params = MODELS["transformer"]()
  n = shapes.num_params(params)
  out = {}
  for bandwidth in (1.0, 10.0, 100.0):
    latency = args.ethernet_latency_us if bandwidth < 100 else args.fast_latency_us
    network = ({"dcn": bandwidth, "ici": args.node_gbit},
               {"dcn": latency, "ici": args.node_latency_us})
    rows = {}
    for nodes in DILOCO_NODES:
      mesh_shape = {"dcn": nodes, "ici": args.node_size}
      row = {}
      for label, mode, name, config in DILOCO_COLUMNS:
        compressor = registry.build(name, "dcn", **config)
        compression = compute.compression_s(name, n) / args.node_size
        if mode == "sync":
          cost = wire.transfers(jaxcomp.hierarchical(compressor, "ici", args.node_size),
                                params, mesh_shape)
          seconds = (args.compute_s["transformer"] + compression
                     + costmodel.exchange_time(cost, *network))
          slow = float(wire.tally(cost).by_axes.get(("dcn",), 0))
        else:
          cost = training.diloco_transfers(
              params, mesh_shape, slow_axis="dcn", fast_axis="ici",
              sync_period=DILOCO_SYNC_PERIOD, inner_tx=jaxcomp.allreduce("ici"),
              outer_compressor=compressor)
          seconds = costmodel.predict_diloco(
              cost, *network,
              compute_s=args.compute_s["transformer"] + compression / DILOCO_SYNC_PERIOD)
          slow = float(cost.per_inner_step().by_axes.get(("dcn",), 0))
        row[label] = {"step_s": seconds, "slow_bytes": slow}
      rows[nodes] = row
    out[bandwidth] = rows
  return out


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:,.1f}"


def diloco_markdown(args, diloco) -> list[str]:
  labels = [label for label, *_ in DILOCO_COLUMNS]
  lines = [
      "",
      f"## 5. Low-communication training: DiLoCo (transformer, nodes of {args.node_size})",
      "",
      f"Per inner step (ms), the transformer's {args.transformer_compute_s:g} s of compute"
      " included: *sync*, `jaxcomp.hierarchical` every step (dense inside a node, the"
      " compressor between nodes on each device's 1/8 shard); *DiLoCo*, a dense mean"
      f" inside the node every step and every H = {DILOCO_SYNC_PERIOD} steps the"
      " pseudo-gradient through the compressor between nodes"
      " (`costmodel.predict_diloco` of `training.diloco_transfers`). Links as in table 4."
      " In brackets: slow-link bytes per device per inner step.",
      "",
      "| between nodes | nodes | " + " | ".join(labels) + " | sync dense / best DiLoCo |",
      "|---|---|" + "---|" * (len(labels) + 1),
  ]
  for bandwidth, rows in diloco.items():
    for nodes, row in rows.items():
      best = min(row[l]["step_s"] for l in labels if l.startswith("DiLoCo"))
      lines.append(
          f"| {bandwidth:g} Gbit/s | {nodes} | " + " | ".join(
              f"{_ms(row[l]['step_s'])} ({row[l]['slow_bytes'] / 1e6:,.2f} MB)" for l in labels)
          + f" | {row['sync dense']['step_s'] / best:.1f}x |")
  return lines


def markdown(args, sparse, lowrank, torus, two_level, diloco=None) -> str:
  lines = [
      "# Scaling by the cost model",
      "",
      "Alpha-beta time (`jaxcomp.costmodel`) of each method's own wire formula; nothing"
      " here is measured on a network. A step is compute + compression + exchange, with"
      " no overlap. Compute per step is given (a GPU's forward and backward:"
      + ", ".join(f" {m} {s:g} s" for m, s in args.compute_s.items())
      + "); compression per element is `experiments.compute.NS_PER_ELEMENT`, measured"
      f" with `experiments.bench_compression` on {compute.DEVICE} (ns: "
      + ", ".join(f"{m} {figure.ns_per_element:g}"
                  for m, figure in compute.NS_PER_ELEMENT.items())
      + "). Scaling efficiency = compute / step.",
      "",
      f"## 1. gTop-k vs Top-k vs dense S-SGD ({args.ethernet_gbit:g} Gbit/s,"
      f" {args.ethernet_latency_us:g} us, density {args.density:g})",
      "",
      "Seed (Shi et al., gTop-k, ICDCS 2019): on 32 workers over 1 Gbit/s Ethernet,"
      " gTop-k S-SGD has 2.7-12x the scaling efficiency of S-SGD and 1.1-1.7x that of"
      " Top-k S-SGD; its exchange is O(k log P), Top-k's O(kP), dense O(n).",
      "",
  ]
  for model, rows in sparse.items():
    lines += [
        f"**{model}** ({shapes.num_params(MODELS[model]()):,} parameters)",
        "",
        "| P | dense exchange (ms) | Top-k exchange (ms) | gTop-k exchange (ms) |"
        " dense eff. | Top-k eff. | gTop-k eff. | gTop-k / dense eff. | gTop-k / Top-k eff. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p, r in rows.items():
      d, t, g = r["allreduce"], r["topk"], r["gtopk"]
      lines.append(
          f"| {p} | {_ms(d['exchange_s'])} | {_ms(t['exchange_s'])} | {_ms(g['exchange_s'])}"
          f" | {d['efficiency']:.3f} | {t['efficiency']:.3f} | {g['efficiency']:.3f}"
          f" | {g['efficiency'] / d['efficiency']:.2f}x | {g['efficiency'] / t['efficiency']:.2f}x |"
      )
    at32 = rows[32]
    d, t, g = at32["allreduce"], at32["topk"], at32["gtopk"]
    lines += [
        "",
        f"Here, at P = 32: gTop-k's scaling efficiency is"
        f" {g['efficiency'] / d['efficiency']:.2f}x dense S-SGD's (seed: 2.7-12x) and"
        f" {g['efficiency'] / t['efficiency']:.2f}x Top-k's (seed: 1.1-1.7x); Top-k's"
        " exchange doubles with P, gTop-k's grows by one round per doubling.",
        "",
    ]
  lines += [
      f"## 2. ACP-SGD vs PowerSGD (rank {args.rank}, P = {args.lowrank_workers})",
      "",
      "Seed (Zhang et al., ACP-SGD, 2023): ACP-SGD sends one factor per step"
      " (alternately P and Q) instead of both, about half of PowerSGD's traffic, and"
      " averages 4.06x over S-SGD and 1.43x over PowerSGD from 8 to 64 GPUs and from"
      " 1 Gbit/s Ethernet to 100 Gbit/s InfiniBand.",
      "",
      "| model | Gbit/s | dense bytes/step | PowerSGD bytes/step | ACP-SGD bytes/step |"
      " ACP / PowerSGD bytes | dense step (ms) | PowerSGD step (ms) | ACP-SGD step (ms) |"
      " ACP speed-up over dense | over PowerSGD |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for model, rows in lowrank.items():
    for bandwidth, r in rows.items():
      d, p, a = r["allreduce"], r["powersgd"], r["acpsgd"]
      lines.append(
          f"| {model} | {bandwidth:g} | {d['bytes']:,.0f} | {p['bytes']:,.0f} | {a['bytes']:,.0f}"
          f" | {a['bytes'] / p['bytes']:.3f} | {_ms(d['step_s'])} | {_ms(p['step_s'])}"
          f" | {_ms(a['step_s'])} | {d['step_s'] / a['step_s']:.2f}x"
          f" | {p['step_s'] / a['step_s']:.2f}x |"
      )
  shares = [r["acpsgd"]["bytes"] / r["powersgd"]["bytes"] for rows in lowrank.values()
            for r in rows.values()]
  speedups = [r["powersgd"]["step_s"] / r["acpsgd"]["step_s"] for rows in lowrank.values()
              for r in rows.values()]
  lines += [
      "",
      f"Here: ACP-SGD sends {min(shares):.3f} to {max(shares):.3f} of PowerSGD's bytes (seed:"
      " about half; above one half because the leaves neither method compresses are sent"
      " dense every step by both). PowerSGD's predicted step over ACP-SGD's is"
      f" {min(speedups):.2f} to {max(speedups):.2f} (seed: 1.43x on average). The"
      " traffic halves, and the compression compute, measured on CPU, is"
      f" {compute.NS_PER_ELEMENT['acpsgd'].ns_per_element:g} ns per element for ACP-SGD"
      f" against {compute.NS_PER_ELEMENT['powersgd'].ns_per_element:g} for PowerSGD"
      " beyond a dense step's (the compute per step above is the same for both): where the"
      " exchange is short, the speed-up goes to 1, as the exchange is then a small part of"
      " the step.",
      "",
      f"## 3. 2D torus vs flat ring (ResNet-50 fp16 dense all-reduce, {args.fast_gbit:g}"
      f" Gbit/s, {args.fast_latency_us:g} us per message, compute {args.torus_compute_s:g} s)",
      "",
      "Seed (Mikami et al., 2018): the 2D-torus all-reduce (reduce-scatter along rows,"
      " all-reduce along columns, all-gather along rows) trained ResNet-50 on ImageNet in"
      " 122 s on 3456 V100 GPUs with 84.75% scaling efficiency at 1024 GPUs; its latency"
      " term grows with rows + cols instead of P, its bytes are the ring's.",
      "",
      "| P | mesh | flat exchange (ms) | of which latency | torus exchange (ms) |"
      " of which latency | flat / torus | flat eff. | torus eff. |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for p, r in torus.items():
    f, t = r["flat"], r["torus"]
    lines.append(
        f"| {p} | {r['mesh']} | {_ms(f['exchange_s'])} | {_ms(f['latency_s'])}"
        f" | {_ms(t['exchange_s'])} | {_ms(t['latency_s'])}"
        f" | {f['exchange_s'] / t['exchange_s']:.2f}x | {f['efficiency']:.3f} | {t['efficiency']:.3f} |"
    )
  big = torus[1024]
  lines += [
      "",
      f"Here, at P = 1024 ({big['mesh']}): the flat ring spends"
      f" {_ms(big['flat']['latency_s'])} ms of its {_ms(big['flat']['exchange_s'])} ms in"
      f" latency, the torus {_ms(big['torus']['latency_s'])} of"
      f" {_ms(big['torus']['exchange_s'])}; the bytes are the same. The torus's advantage"
      " is latency only, so it appears from about 256 workers and grows with P. The"
      " efficiencies depend on the given compute and are not a reproduction of the"
      " seed's measured 84.75%.",
      "",
      f"## 4. Two levels: nodes of {args.node_size} (ResNet-50, density {args.density:g},"
      f" rank {args.rank})",
      "",
      f"Inside a node {args.node_gbit:g} Gbit/s and {args.node_latency_us:g} us per message"
      " (NVLink-class); between nodes 1 and 10 Gbit/s at"
      f" {args.ethernet_latency_us:g} us, 100 Gbit/s at {args.fast_latency_us:g} us."
      " Step = compute + compression + exchange (ms). Layouts: *flat*, one ring over every"
      " device, priced at the slow links; *torus*, the method over both axes, fast first;"
      " *hier*, `jaxcomp.hierarchical`: a dense reduce-scatter inside the node, the"
      " method between nodes on each device's 1/8 shard (its compression compute"
      " divided by 8), an all-gather back. *best*: `costmodel.recommend`'s first among"
      f" {', '.join(TWO_LEVEL_METHODS)} in the three layouts.",
      "",
      "| between nodes | nodes | devices | " + " | ".join(
          f"{m} {l.replace('hierarchical', 'hier')}" for m, l in TWO_LEVEL_COLUMNS)
      + " | best | dense flat / best |",
      "|---|---|---|" + "---|" * (len(TWO_LEVEL_COLUMNS) + 2),
  ]
  for bandwidth, rows in two_level.items():
    for nodes, r in rows.items():
      steps = r["steps_s"]
      lines.append(
          f"| {bandwidth:g} Gbit/s | {nodes} | {nodes * args.node_size} | "
          + " | ".join(_ms(steps[f"{m}/{l}"]) for m, l in TWO_LEVEL_COLUMNS)
          + f" | {r['best']} | {steps['allreduce/flat'] / steps[r['best']]:.1f}x |")
  hier_wins = [(b, n) for b, rows in two_level.items() for n, r in rows.items()
               if r["steps_s"]["gtopk/hierarchical"] < r["steps_s"]["gtopk/flat"]]
  lines += [
      "",
      f"Here: hierarchical gTop-k is faster than flat gTop-k in {len(hier_wins)} of"
      f" {sum(len(rows) for rows in two_level.values())} settings; the flat butterfly's"
      " rounds inside a node already run on the fast links, so the hierarchical one"
      " wins by its 1/8 compression compute and by sending k/8 instead of k in each"
      " round between nodes. The dense torus is the hierarchical dense exchange"
      " (reduce-scatter inside, all-reduce between, all-gather inside).",
  ]
  if diloco is not None:
    lines += diloco_markdown(args, diloco)
  return "\n".join(lines) + "\n"


def _exchange_plot(path: pathlib.Path, workers, series: dict, title: str) -> pathlib.Path:
  """Exchange time per step against P, log-log, one line per ``series`` entry."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for label, seconds in series.items():
    ax.plot(list(workers), seconds, marker="o", label=label)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("workers P")
  ax.set_ylabel("exchange per step (s)")
  ax.set_title(title)
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot(sparse, torus, out: pathlib.Path) -> list[pathlib.Path]:
  rows = sparse["resnet50"]
  sparse_series = {
      label: [rows[p][name]["exchange_s"] for p in rows]
      for name, label in (("allreduce", "dense S-SGD, O(n)"), ("topk", "Top-k, O(kP)"),
                          ("gtopk", "gTop-k, O(k log P)"))
  }
  torus_series = {
      label: [r[kind]["exchange_s"] for r in torus.values()]
      for kind, label in (("flat", "flat ring"), ("torus", "2D torus"))
  }
  return [
      _exchange_plot(out / "scaling_sparse.png", rows, sparse_series,
                     "ResNet-50 at 1 Gbit/s, density 0.001 (cost model)"),
      _exchange_plot(out / "scaling_torus.png", torus, torus_series,
                     "ResNet-50 fp16 all-reduce, flat ring vs 2D torus (cost model)"),
  ]


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m experiments.scaling",
      description="Cost-model tables and plots for P from 4 to 4096 workers.",
  )
  p.add_argument("--out", default=str(RESULTS_DIR), help="output directory")
  p.add_argument("--density", type=float, default=0.001, help="Top-k / gTop-k density")
  p.add_argument("--rank", type=int, default=4, help="PowerSGD / ACP-SGD rank")
  p.add_argument("--lowrank-workers", type=int, default=32, help="P of the low-rank table")
  p.add_argument("--ethernet-gbit", type=float, default=1.0)
  p.add_argument("--ethernet-latency-us", type=float, default=50.0)
  p.add_argument("--fast-gbit", type=float, default=100.0, help="the torus table's network")
  p.add_argument("--fast-latency-us", type=float, default=5.0)
  p.add_argument("--resnet50-compute-s", type=float, default=0.2,
                 help="given forward+backward seconds of ResNet-50 per worker")
  p.add_argument("--transformer-compute-s", type=float, default=0.4,
                 help="given forward+backward seconds of the transformer per worker")
  p.add_argument("--torus-compute-s", type=float, default=0.1,
                 help="given compute seconds per step in the torus table")
  p.add_argument("--node-size", type=int, default=8, help="devices per node (two-level table)")
  p.add_argument("--node-gbit", type=float, default=2400.0,
                 help="links inside a node, Gbit/s (NVLink-class: 300 GB/s)")
  p.add_argument("--node-latency-us", type=float, default=2.0)
  return p


def main(argv=None) -> None:
  args = parser().parse_args(argv)
  args.compute_s = {"resnet50": args.resnet50_compute_s,
                    "transformer": args.transformer_compute_s}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  sparse, lowrank, torus = sparse_table(args), lowrank_table(args), torus_table(args)
  two_level, diloco = two_level_table(args), diloco_table(args)
  text = markdown(args, sparse, lowrank, torus, two_level, diloco)
  (out / "scaling.md").write_text(text)
  (out / "scaling.json").write_text(json.dumps(
      {"config": {k: v for k, v in vars(args).items() if k != "out"},
       "sparse": sparse, "lowrank": lowrank, "torus": torus, "two_level": two_level,
       "diloco": diloco},
      indent=1,
  ) + "\n")
  plot(sparse, torus, out)
  print(text)


if __name__ == "__main__":
  main()
