"""Compression compute per step: every jaxcomp compressor against the dense all-reduce.

On one process with a mesh of one device the collectives cost next to
nothing, so the time of ``update`` (compress, reduce, decompress) is the
compressor's compute (:func:`experiments.compute.time_update`). The rows are
every method of :data:`jaxcomp.registry.METHODS` with its defaults (``--rank``
and ``--density`` replace its own) and the :data:`VARIANTS`. Gradient shapes
are generated (``experiments.shapes``): ResNet-50 and a 12-layer, width-768
transformer. Each row is the median of ``--repeats`` timed steps after a
warm-up step (the compile), the state fed back from step to step (ACP-SGD
alternates its two halves); the ratio is to dense ``allreduce`` timed in the
same run. The last column is the formula's bytes per device per step for
``--devices`` workers on a ring, for scale.

  python -m experiments.bench_compression --model resnet50 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable

import jax
import optax

from experiments import compute
from experiments import shapes
from jaxcomp import registry
from jaxcomp import wire

MODELS = {"resnet50": shapes.resnet50, "transformer": shapes.transformer}


# Extra rows beside each method's registry defaults: name -> configurations.
VARIANTS = {"signsgd": ({"majority_vote": True},)}


def _label(name: str, config: dict) -> str:
  settings = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in config.items())
  return f"{name}({settings})" if settings else name


def compressors(rank: int, density: float) -> dict[str, Callable[[], optax.GradientTransformation]]:
  """Label -> factory of every registered method, and of its :data:`VARIANTS`.

  Each method runs with its :data:`jaxcomp.registry.METHODS` defaults, its
  ``rank`` or ``density`` (where it has one) replaced by these.
  """
  overrides = {"rank": rank, "density": density}
  table = {}
  for method in registry.METHODS.values():
    config = {k: overrides.get(k, v) for k, v in method.defaults.items()}
    for variant in ({}, *VARIANTS.get(method.name, ())):
      settings = {**config, **variant}
      table[_label(method.name, settings)] = functools.partial(
          registry.build, method.name, compute.AXIS, **settings)
  return table


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
    print(f"{'compressor':<28}{'ms/step':>10}{'x dense':>9}{'compile s':>11}"
          f"{f'MB/dev P={args.devices}':>15}")
    baseline = None
    for name in names:
      tx = table[name]()
      compile_s, step_s = compute.time_update(tx, grads, args.repeats)
      baseline = step_s if name == "allreduce" else baseline
      mbytes = float(wire.expected_bytes(tx, grads, args.devices).total) / 1e6
      print(f"{name:<28}{step_s * 1e3:>10.1f}{step_s / baseline:>9.2f}"
            f"{compile_s:>11.1f}{mbytes:>15.3f}", flush=True)


if __name__ == "__main__":
  main()
