"""Compression compute per step: every jaxcomp compressor against the dense all-reduce.

On one process with a mesh of one device the collectives cost next to
nothing, so the time of ``update`` (compress, reduce, decompress) is the
compressor's compute. Gradient shapes are generated (``experiments.shapes``):
ResNet-50 and a 12-layer, width-768 transformer. Each row is the median of
``--repeats`` timed steps after a warm-up step (the compile), the state fed back
from step to step (ACP-SGD alternates its two halves); the ratio is to dense
``allreduce`` timed in the same run. The last column is the formula's bytes
per device per step for ``--devices`` workers on a ring, for scale.

  python -m experiments.bench_compression --model resnet50 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from experiments import shapes
import jaxcomp
from jaxcomp import training
from jaxcomp import wire

MODELS = {"resnet50": shapes.resnet50, "transformer": shapes.transformer}
AXIS = "data"


def compressors(rank: int, density: float) -> dict[str, Callable[[], object]]:
  """Name -> factory of every jaxcomp compressor, as this benchmark configures it."""
  return {
      "allreduce": lambda: jaxcomp.allreduce(AXIS),
      "cast(bf16)": lambda: jaxcomp.cast(jnp.bfloat16, AXIS),
      "signsgd": lambda: jaxcomp.signsgd(AXIS),
      "signsgd(majority)": lambda: jaxcomp.signsgd(AXIS, majority_vote=True),
      f"powersgd(r={rank})": lambda: jaxcomp.powersgd(rank, AXIS),
      f"acpsgd(r={rank})": lambda: jaxcomp.acpsgd(rank, AXIS),
      f"topk(d={density:g})": lambda: jaxcomp.topk(density, AXIS),
      f"gtopk(d={density:g})": lambda: jaxcomp.gtopk(density, AXIS),
      f"randomk(d={density:g})": lambda: jaxcomp.randomk(density, AXIS),
      f"dgc(d={density:g})": lambda: jaxcomp.dgc(density, AXIS),
  }


def time_update(tx, grads, repeats: int) -> tuple[float, float]:
  """``(compile seconds, median seconds per step)`` of ``tx.update`` on one device."""
  mesh = training.make_mesh(1)
  step = training.make_update(tx, mesh, AXIS, donate=True)
  state = training.init_state(tx, grads, mesh, AXIS)
  grads = training.stack_per_device(grads, mesh, AXIS)
  start = time.perf_counter()
  out, state = step(grads, state)
  jax.block_until_ready((out, state))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out, state = step(grads, state)
    jax.block_until_ready((out, state))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m experiments.bench_compression",
      description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
  parser.add_argument("--repeats", type=int, default=5, help="timed steps per compressor")
  parser.add_argument("--rank", type=int, default=4, help="PowerSGD / ACP-SGD rank")
  parser.add_argument("--density", type=float, default=0.001, help="sparsifiers' density")
  parser.add_argument("--devices", type=int, default=8,
                      help="workers for the bytes column (formula, ring)")
  parser.add_argument("--only", default="",
                      help="comma-separated name prefixes of compressors to run")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be >= 1")

  models = list(MODELS) if args.model == "all" else [args.model]
  table = compressors(args.rank, args.density)
  wanted = [p for p in args.only.split(",") if p]
  names = [n for n in table if n == "allreduce" or not wanted
           or any(n.startswith(p) for p in wanted)]
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, one device,"
        f" median of {args.repeats} steps")
  for model in models:
    grads = shapes.normal(MODELS[model](), jax.random.key(0))
    n = shapes.num_params(grads)
    print(f"\n{model}: {n:,} gradient elements")
    print(f"{'compressor':<22}{'ms/step':>10}{'x dense':>9}{'compile s':>11}"
          f"{f'MB/dev P={args.devices}':>15}")
    baseline = None
    for name in names:
      tx = table[name]()
      compile_s, step_s = time_update(tx, grads, args.repeats)
      baseline = step_s if name == "allreduce" else baseline
      mbytes = float(wire.expected_bytes(tx, grads, args.devices).total) / 1e6
      print(f"{name:<22}{step_s * 1e3:>10.1f}{step_s / baseline:>9.2f}"
            f"{compile_s:>11.1f}{mbytes:>15.3f}", flush=True)


if __name__ == "__main__":
  main()
