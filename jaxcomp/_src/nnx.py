"""Flax NNX integration: see the public :mod:`jaxcomp.nnx` for the loop it makes."""

from __future__ import annotations

import functools
from typing import Callable

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
import optax

from jaxcomp._src import checks
from jaxcomp._src import protocol
from jaxcomp._src import layout

# The field of PerDeviceState that names the per-device leaves in an
# optimizer's state paths (nnx.PathContains finds it).
_FIELD = "jaxcomp_per_device"
PerDeviceState = layout.PerDeviceState


def per_device(
    tx: optax.GradientTransformation, mesh: Mesh, axis_name: checks.AxisName
) -> optax.GradientTransformation:
  """``tx`` with one state per device, for ``nnx.Optimizer`` under :func:`data_parallel`.

  :func:`jaxcomp.training.per_device` for NNX's parameter states: its state is
  laid out per device as :func:`jaxcomp.training.init_state` lays it out
  (every device's block one after the other along each leaf's first
  dimension), built outside the mesh as ``nnx.Optimizer`` builds it.

  Args:
    tx: an optax chain holding jaxcomp compressors built over ``axis_name``.
    mesh: the mesh of the data-parallel step.
    axis_name: its data axis, or pair of axes.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`PerDeviceState`,
    whose ``update`` runs inside :func:`data_parallel`, where each device
    sees its own block.
  """
  inner = layout.per_device(tx, mesh, axis_name)

  def init_fn(params):
    return inner.init(nnx.as_pure(params))

  return optax.GradientTransformation(init_fn, inner.update)


def _check_optimizers(args, mesh: Mesh, axis_name) -> None:
  """Every ``nnx.Optimizer`` with a per-device state has it for this mesh's device count."""
  count = layout.num_replicas(mesh, axis_name)
  for arg in args:
    for _, node in nnx.iter_graph(arg) if isinstance(arg, nnx.Pytree) else ():
      if not isinstance(node, nnx.Optimizer):
        continue
      built_for = layout.per_device_count(node.tx)
      if built_for is not None and built_for != count:
        raise ValueError(
            f"the optimizer's per-device state is for {built_for} devices, the mesh"
            f" has {count} along {axis_name!r}")


def _replicated_state_error(axis_name) -> str:
  return ("a jaxcomp compressor's update runs in the step with its state (residuals,"
          " momenta), which is per device, held as one replicated copy whose device"
          " copies would differ: build its nnx.Optimizer as nnx.Optimizer(model,"
          f" jaxcomp.nnx.per_device(tx, mesh, {axis_name!r}), wrt=...)")


def data_parallel(mesh: Mesh, axis_name: checks.AxisName) -> Callable[[Callable], Callable]:
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
    ValueError: at the first trace, the step runs a jaxcomp compressor's
      update on a state not held per device (an ``nnx.Optimizer`` built
      without :func:`per_device`, whatever wraps the compressor in its
      transformation), or an ``nnx.Optimizer`` among the arguments has a
      per-device state built for another device count.
    TypeError: the step returns a non-floating array (say what to average).
  """
  axes = layout.mesh_axes(mesh, axis_name)
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
      # Traced here, a compressor's update outside per_device (whose state is
      # held replicated) raises: an nnx.Optimizer keeps no model nor parameter
      # tree to search its transformation with, and the step shows what runs.
      with protocol.replicated_state(_replicated_state_error(axis_name)):
        return nnx.shard_map(averaged, mesh=mesh, in_specs=in_specs,
                             out_specs=PartitionSpec(), check_vma=False)(*args)

    return wrapped

  return decorator
