"""Flax NNX: a compressed data-parallel loop that keeps ``nnx.Optimizer`` and ``nnx.jit``.

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
folded into one copy. An optimizer that holds a jaxcomp compressor without
:func:`per_device` is refused at the first trace, where it would otherwise
train with eight different residuals held as one.

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

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
import optax

from jaxcomp import base
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import training

# The field of PerDeviceState that names the per-device leaves in an
# optimizer's state paths (nnx.PathContains finds it).
_FIELD = "jaxcomp_per_device"


class PerDeviceState(NamedTuple):
  """State of :func:`per_device`: the wrapped chain's state laid out per device.

  Every leaf as :func:`jaxcomp.training.init_state` lays it out: the devices'
  states one after the other along its first dimension (``[devices]`` for a
  scalar).
  """

  jaxcomp_per_device: optax.OptState


def _check_axes(mesh: Mesh, axis_name: base.AxisName) -> tuple[str, ...]:
  """``axis_name`` as a tuple of axes, each one of ``mesh``'s."""
  axes = base.check_axis_name(axis_name)
  missing = [a for a in axes if a not in mesh.shape]
  if missing:
    raise ValueError(f"`axis_name` {axis_name!r} names axes {missing} that `mesh`"
                     f" {dict(mesh.shape)} does not have")
  return axes


def per_device(
    tx: optax.GradientTransformation, mesh: Mesh, axis_name: base.AxisName
) -> optax.GradientTransformation:
  """``tx`` with one state per device, for ``nnx.Optimizer`` under :func:`data_parallel`.

  Args:
    tx: an optax chain holding jaxcomp compressors built over ``axis_name``.
    mesh: the mesh of the data-parallel step.
    axis_name: its data axis, or pair of axes.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`PerDeviceState`:
    ``init`` (outside the mesh) repeats ``tx.init(params)`` once per device
    along each leaf's first dimension, sharded over ``axis_name``
    (:func:`jaxcomp.training.tile_per_device`); ``update`` (inside
    :func:`data_parallel`, where each device sees its own block) runs
    ``tx.update`` on the block.
  """
  _check_axes(mesh, axis_name)
  count = training.num_replicas(mesh, axis_name)

  def init_fn(params):
    params = nnx.as_pure(params)
    registry.check_chain(tx, params)
    return PerDeviceState(training.tile_per_device(tx.init(params), mesh, axis_name))

  def update_fn(updates, state, params=None):
    like = jax.eval_shape(tx.init, updates)
    blocks = state.jaxcomp_per_device
    if not training.is_blocks_of(blocks, like):
      raise ValueError(
          "the per-device state holds every device's block here, not this device's own:"
          " call the optimizer's update inside a step wrapped by"
          f" jaxcomp.nnx.data_parallel(mesh, {axis_name!r}), which gives each device its"
          f" own block of the {count}")
    updates, inner = tx.update(updates, training.blocks_to_local(blocks, like), params)
    return updates, PerDeviceState(training.local_to_blocks(inner))

  update_fn.jaxcomp_per_device_count = count  # read by data_parallel's check
  return optax.GradientTransformation(init_fn, update_fn)


def _per_device_count(tx: Any):
  """The device count of a :func:`per_device` transformation, ``None`` for any other."""
  return getattr(getattr(tx, "update", None), "jaxcomp_per_device_count", None)


def _check_optimizers(args, mesh: Mesh, axis_name) -> None:
  """Every ``nnx.Optimizer`` holding a compressor keeps its state per device."""
  count = training.num_replicas(mesh, axis_name)
  for arg in args:
    for _, node in nnx.iter_graph(arg) if isinstance(arg, nnx.Pytree) else ():
      if not isinstance(node, nnx.Optimizer):
        continue
      built_for = _per_device_count(node.tx)
      if built_for is not None:
        if built_for != count:
          raise ValueError(
              f"the optimizer's per-device state is for {built_for} devices, the mesh"
              f" has {count} along {axis_name!r}")
      elif protocol.find_specs(node.tx):
        raise ValueError(
            "an nnx.Optimizer holds a jaxcomp compressor whose state (residuals,"
            " momenta) is per device, but it would be held as one replicated copy whose"
            " device copies differ: build it as nnx.Optimizer(model,"
            f" jaxcomp.nnx.per_device(tx, mesh, {axis_name!r}), wrt=...)")


def data_parallel(mesh: Mesh, axis_name: base.AxisName) -> Callable[[Callable], Callable]:
  """Decorator: runs an NNX train step on every device with its part of the batch.

  Put it under ``@nnx.jit``. The step's arguments: NNX objects (the model,
  the optimizer) are replicated, but for the leaves of a :func:`per_device`
  state, split over ``axis_name`` one block per device; every other argument
  (arrays: the batch) is split along its leading axis. Each floating array
  the step returns (the loss, metrics) is averaged over the devices, and so
  is every ``nnx.BatchStat`` (BatchNorm's running statistics, updated from
  each device's part of the batch) after the step, as a cross-replica batch
  norm does; any other variable the step changes must change alike on every
  device (the parameters do: the compressor's mean is the same everywhere).

  Args:
    mesh: the mesh; ``axis_name`` must be among its axes.
    axis_name: the data axis, or pair of axes (the compressors' axes).

  Returns:
    A decorator of ``step(*args) -> outputs``.

  Raises:
    ValueError: at the first trace, an ``nnx.Optimizer`` among the arguments
      holds a jaxcomp compressor without :func:`per_device`, or a
      per-device state built for another device count.
    TypeError: the step returns a non-floating array (say what to average).
  """
  axes = _check_axes(mesh, axis_name)
  split = PartitionSpec(axes[0] if len(axes) == 1 else axes)
  objects = nnx.StateSharding({nnx.PathContains(_FIELD): split, ...: PartitionSpec()})
  batch = NamedSharding(mesh, split)
  explicit = any(t == AxisType.Explicit for t in mesh.axis_types)

  def decorator(step: Callable) -> Callable:

    def averaged(*args):
      out = step(*args)
      # Running statistics updated from this device's part of the batch: one
      # copy for all, as a cross-replica batch norm keeps them.
      for arg in args:
        for _, node in nnx.iter_graph(arg) if isinstance(arg, nnx.Pytree) else ():
          if isinstance(node, nnx.BatchStat):
            node[...] = lax.pmean(node[...], axes)

      def mean(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
          raise TypeError(
              "a step under jaxcomp.nnx.data_parallel returns the mean over the devices of"
              f" each output; got a {jnp.result_type(x)} output: return floats")
        return lax.pmean(x, axes)

      return jax.tree.map(mean, out)

    @functools.wraps(step)
    def wrapped(*args):
      _check_optimizers(args, mesh, axis_name)
      in_specs = tuple(objects if isinstance(a, nnx.Pytree) else split for a in args)
      if explicit:  # an Explicit mesh (jax.make_mesh's default) does not reshard by itself
        args = tuple(a if isinstance(a, nnx.Pytree) else jax.sharding.reshard(a, batch)
                     for a in args)
      # The compressors' means are identical on every device by construction
      # (tested bit for bit); the type system cannot see it through ppermute
      # and all_to_all, so the check is off here rather than in user code.
      return nnx.shard_map(averaged, mesh=mesh, in_specs=in_specs,
                           out_specs=PartitionSpec(), check_vma=False)(*args)

    return wrapped

  return decorator
