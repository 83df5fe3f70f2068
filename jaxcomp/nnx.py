"""Flax NNX: a compressed data-parallel loop that keeps ``nnx.Optimizer`` and ``nnx.jit``.

Needs Flax: ``pip install 'jaxcomp[flax]'``.

A jaxcomp compressor's state is per device: each device's error-feedback
residual (and momentum, factors, key) is its own. ``nnx.Optimizer`` holds one
state for the whole model, so two things are added to a Flax loop:

* :func:`per_device` wraps the optax chain: its state is held per device,
  sharded over the data axes (built outside the mesh, as ``nnx.Optimizer``
  builds it), and its update works on this device's block;
* :func:`data_parallel` wraps the train step in ``nnx.shard_map`` with the
  specs that follow: the model and the rest of the optimizer replicated, the
  per-device state and every array argument (the batch) split over the data
  axes, the floating outputs (the loss, metrics) averaged over the devices.

The compressor's mean is identical on every device (bit for bit, tested), so
the replicated parameters stay replicated; the per-device state is never
folded into one copy. A step that runs a jaxcomp compressor without
:func:`per_device` around it is refused at the first trace, where it would
otherwise train with eight different residuals held as one.

Example (8 fake CPU devices; a plain NNX loop plus the marked lines)::

  import jax, jax.numpy as jnp, optax, jaxcomp
  from flax import nnx

  mesh = jax.make_mesh((8,), ("data",))                                  # added
  model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  tx = optax.chain(jaxcomp.gtopk(0.1, "data"), optax.sgd(0.1))           # added
  optimizer = nnx.Optimizer(model, jaxcomp.nnx.per_device(tx, mesh, "data"),
                            wrt=nnx.Param)                               # changed

  @nnx.jit
  @jaxcomp.nnx.data_parallel(mesh, "data")                               # added
  def train_step(model, optimizer, x, y):
    loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  x, y = jnp.ones((64, 16)), jnp.zeros(64, jnp.int32)
  loss = train_step(model, optimizer, x, y)
"""

try:
  import flax  # noqa: F401  pylint: disable=unused-import
except ImportError as e:  # the optional dependency, named with what to install
  raise ImportError(
      "jaxcomp.nnx needs Flax, which is not installed: pip install 'jaxcomp[flax]'"
  ) from e

from jaxcomp._src.nnx import PerDeviceState as PerDeviceState
from jaxcomp._src.nnx import data_parallel as data_parallel
from jaxcomp._src.nnx import per_device as per_device

__all__ = (
    "data_parallel",
    "per_device",
    "PerDeviceState",
)
