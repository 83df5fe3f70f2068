"""Compile time against the number of gradient leaves, per registered method.

A model's gradient is a pytree of many leaves (ResNet-50 has 161, a
transformer hundreds); anything the step does leaf by leaf adds to the
program, and XLA's compile time grows faster than the program. This prints,
for every method of :data:`jaxcomp.registry.METHODS` and for a whole
:func:`jaxcomp.training.make_step` with dense ``allreduce``, the seconds to
compile one step on 8 fake CPU devices with ``L`` leaves of shape (4, 6),
and the ratio of the largest ``L`` to the smallest against the ratio of the
leaf counts (1.0 would be linear).

  python -m experiments.bench_compile --leaves 100,500
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxcomp import registry  # noqa: E402
from jaxcomp import training  # noqa: E402

# What a model of tiny leaves needs to send anything; the rest are defaults.
SMALL_MODEL = {"density": 0.1, "rank": 1}


def _params(leaves: int):
  return {f"w{i:04d}": jnp.zeros((4, 6)) for i in range(leaves)}


def compile_update(name: str, leaves: int) -> float:
  """Seconds to compile ``tx.update`` of ``name`` over 8 devices."""
  config = {k: v for k, v in SMALL_MODEL.items() if k in registry.get(name).defaults}
  tx = registry.build(name, "data", **config)
  mesh = training.make_mesh(8)
  params = _params(leaves)
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  start = time.perf_counter()
  training.make_update(tx, mesh, "data").lower(grads, state).compile()
  return time.perf_counter() - start


def compile_step(leaves: int) -> float:
  """Seconds to compile a whole training step (loss, gradient, allreduce, SGD)."""
  tx = optax.chain(registry.build("allreduce", "data"), optax.sgd(0.1))
  mesh = training.make_mesh(8)
  params = _params(leaves)

  def loss_fn(params, batch):
    return sum(jnp.sum((p - batch) ** 2) for p in jax.tree.leaves(params))

  state = training.init_state(tx, params, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data")
  batch = training.shard(jnp.zeros((8, 4, 6)), mesh, "data")
  start = time.perf_counter()
  step.lower(training.replicate(params, mesh), state, batch).compile()
  return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m experiments.bench_compile", description=__doc__.split("\n\n")[0])
  parser.add_argument("--leaves", default="100,500",
                      help="comma-separated leaf counts (smallest first)")
  parser.add_argument("--methods", default=",".join(registry.names()),
                      help="comma-separated registry names")
  args = parser.parse_args(argv)
  counts = [int(c) for c in args.leaves.split(",")]
  rows = [(name, lambda n, name=name: compile_update(name, n))
          for name in args.methods.split(",")]
  rows.append(("make_step(allreduce)", compile_step))
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, 8 devices,"
        f" compile seconds per leaf count; growth = ratio of times / ratio of counts")
  print(f"{'step':<22}" + "".join(f"{c:>9}" for c in counts) + f"{'growth':>9}")
  for label, measure in rows:
    seconds = [measure(c) for c in counts]
    growth = (seconds[-1] / seconds[0]) / (counts[-1] / counts[0])
    print(f"{label:<22}" + "".join(f"{s:>9.1f}" for s in seconds) + f"{growth:>9.2f}",
          flush=True)


if __name__ == "__main__":
  main()
