"""Where data lives on a data-parallel mesh: replicated parameters, a split batch,
and the one layout of per-device state.

A compressor's state differs per device (error-feedback residuals, local
momenta), so it is held outside ``shard_map`` in one layout everywhere (the
training steps, :func:`per_device` in a hand-written ``shard_map``,
``jaxcomp.nnx``, the pmap helpers and checkpoints): each leaf is repeated once
per device along its first dimension and sharded over the data axes, so that
inside ``shard_map`` a device's block is its own state as ``tx.init`` made it
(a scalar's block is ``[1]``). No axis is added: a donated step then updates
every residual in place, where through a new leading axis XLA copies each one
first. A state in another layout is refused at the first trace, by name.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import protocol
from jaxcomp._src import registry

def make_mesh(
    shape: int | Sequence[int],
    axis_names: Sequence[str] = ("data",),
    devices: Optional[Sequence[jax.Device]] = None,
) -> Mesh:
  """A mesh of ``shape`` (an int or one size per axis) over the first devices.

  Args:
    shape: e.g. ``8`` for one data axis, ``(2, 4)`` with
      ``axis_names=("x", "y")`` for the 2D torus.
    axis_names: one name per mesh axis.
    devices: defaults to ``jax.devices()``.
  """
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  if len(shape) != len(axis_names):
    raise ValueError(f"`shape` {shape} and `axis_names` {tuple(axis_names)} differ in length")
  devices = list(jax.devices() if devices is None else devices)
  count = math.prod(shape)
  if count > len(devices):
    raise ValueError(f"`shape` {shape} needs {count} devices, {len(devices)} available")
  grid = np.array(devices[:count], dtype=object).reshape(shape)
  return Mesh(grid, tuple(axis_names))


def axes_spec(axis_name: checks.AxisName) -> PartitionSpec:
  """The ``PartitionSpec`` that splits a leading dimension over the data axes."""
  axes = checks.check_axis_name(axis_name)
  return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def mesh_axes(mesh: Mesh, axis_name: checks.AxisName) -> tuple[str, ...]:
  """``axis_name`` as a tuple of axes, each one of ``mesh``'s (a ``ValueError`` naming the others)."""
  axes = checks.check_axis_name(axis_name)
  missing = [a for a in axes if a not in mesh.shape]
  if missing:
    raise ValueError(f"`axis_name` {axis_name!r} names axes {missing} that `mesh`"
                     f" {dict(mesh.shape)} does not have")
  return axes


def num_replicas(mesh: Mesh, axis_name: checks.AxisName) -> int:
  """Devices along the data axes of ``mesh``."""
  return math.prod(mesh.shape[a] for a in checks.check_axis_name(axis_name))


def replicate(tree: chex.ArrayTree, mesh: Mesh) -> chex.ArrayTree:
  """``tree`` placed whole on every device of ``mesh`` (parameters).

  Always a copy: :func:`make_step` donates the parameters, which must not
  delete the caller's own arrays (``device_put`` keeps the caller's buffer as
  one device's shard, whatever ``may_alias`` says).
  """
  return _replicated(mesh)(tree)


@functools.lru_cache(maxsize=64)
def _replicated(mesh: Mesh) -> Callable[[chex.ArrayTree], chex.ArrayTree]:
  """:func:`replicate`'s copies, in one program for the whole tree."""
  return jax.jit(lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree),
                 out_shardings=NamedSharding(mesh, PartitionSpec()))


def shard(batch: chex.ArrayTree, mesh: Mesh, axis_name: checks.AxisName) -> chex.ArrayTree:
  """``batch`` split along its leading axis, one part per device."""
  return jax.device_put(batch, NamedSharding(mesh, axes_spec(axis_name)))


def state_sharding(mesh: Mesh, axis_name: checks.AxisName, leaf) -> NamedSharding:
  """Per-device state is sharded over the data axes; a zero-size leaf is replicated.

  A step's zero-size outputs come back replicated (they hold nothing to
  shard), so the state goes in the same way and the step compiles once.
  """
  empty = math.prod(jnp.shape(leaf)) == 0
  return NamedSharding(mesh, PartitionSpec() if empty else axes_spec(axis_name))


def _repeated(tree: chex.ArrayTree, mesh: Mesh, axis_name: checks.AxisName,
              stacked: bool) -> chex.ArrayTree:
  """Every leaf of ``tree`` once per device, sharded over the data axes: along a
  new leading axis (``stacked``) or along its first dimension."""
  leaves, treedef = jax.tree.flatten(tree)
  shapes = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
  return jax.tree.unflatten(treedef, _repeat(mesh, axis_name, stacked, shapes)(leaves))


@functools.lru_cache(maxsize=64)
def _repeat(mesh: Mesh, axis_name: checks.AxisName, stacked: bool,
            shapes: tuple) -> Callable[[list], list]:
  """:func:`_repeated`'s program for leaves of ``shapes``: one for the whole tree,
  where a broadcast per leaf compiles one per leaf shape."""
  count = num_replicas(mesh, axis_name)

  def repeated_shape(shape):
    return (count,) + shape if stacked else per_device_shape(shape, count)

  def repeat(leaves):
    return [jnp.broadcast_to(x, (count,) + jnp.shape(x)).reshape(repeated_shape(jnp.shape(x)))
            for x in leaves]

  shardings = [state_sharding(mesh, axis_name, jax.ShapeDtypeStruct(repeated_shape(shape), dtype))
               for shape, dtype in shapes]
  return jax.jit(repeat, out_shardings=shardings)


def stack_per_device(tree: chex.ArrayTree, mesh: Mesh, axis_name: checks.AxisName) -> chex.ArrayTree:
  """Each leaf copied once per device along a new leading axis, sharded over it.

  The layout of per-device data (gradients for :func:`make_update`); state
  takes :func:`tile_per_device`'s.
  """
  return _repeated(tree, mesh, axis_name, True)


def per_device_shape(shape: Sequence[int], count: int) -> tuple[int, ...]:
  """The shape of a per-device leaf whose every one of ``count`` devices holds ``shape``.

  ``(count * d0, d1, ...)``: the devices' blocks one after the other along
  the first dimension; ``(count,)`` for a scalar.
  """
  shape = tuple(shape)
  return (count,) if not shape else (count * shape[0],) + shape[1:]


def tile_per_device(tree: chex.ArrayTree, mesh: Mesh, axis_name: checks.AxisName) -> chex.ArrayTree:
  """Each leaf repeated once per device along its first dimension, sharded over it.

  The per-device state's layout (:func:`per_device_shape`): inside
  ``shard_map`` over ``axis_name`` a device's block is the leaf itself, a
  scalar's is ``[1]``. No axis is added, so a step updates each donated leaf
  in place (a new leading axis is read through a reshape, and XLA then
  copies every residual before writing it). A zero-size leaf is replicated.
  """
  return _repeated(tree, mesh, axis_name, False)


def blocks_to_local(blocks: chex.ArrayTree, like: chex.ArrayTree) -> chex.ArrayTree:
  """Inside ``shard_map``: each device's blocks as ``like``'s shapes (a scalar's ``[1]`` to ``[]``)."""
  return jax.tree.map(lambda x, l: x.reshape(jnp.shape(l)), blocks, like)


def local_to_blocks(state: chex.ArrayTree) -> chex.ArrayTree:
  """The inverse of :func:`blocks_to_local`: a scalar back to its ``[1]`` block."""
  return jax.tree.map(lambda x: x.reshape(1) if jnp.ndim(x) == 0 else x, state)


def is_blocks_of(blocks: chex.ArrayTree, like: chex.ArrayTree) -> bool:
  """Whether ``blocks`` are one device's blocks of a state shaped like ``like``."""
  want, want_def = jax.tree.flatten(jax.eval_shape(local_to_blocks, like))
  got, got_def = jax.tree.flatten(blocks)
  return got_def == want_def and all(jnp.shape(g) == w.shape for g, w in zip(got, want))


def init_state(
    tx: optax.GradientTransformation, params: optax.Params, mesh: Mesh,
    axis_name: checks.AxisName,
) -> optax.OptState:
  """``tx.init(params)`` laid out per device (:func:`tile_per_device`), sharded over the data axes.

  ``init`` binds no mesh axis, so it runs here outside ``shard_map``; every
  device starts from the same state and the residuals diverge from step one.
  A chain that breaks what a compressor in it requires after it (momentum
  after :func:`jaxcomp.dgc`) is refused first (:func:`jaxcomp.check_chain`).
  """
  if per_device_count(tx) is not None:
    raise TypeError("`tx` is a `per_device` transformation, whose `init` lays its state out"
                    " per device already: call `tx.init(params)`")
  registry.check_chain(tx, params)
  return tile_per_device(tx.init(params), mesh, axis_name)


def check_layout(opt_state: optax.OptState, count: int, what: str) -> None:
  """A clear error for a state that no per-device layout of ``count`` devices gives."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % count:
      raise ValueError(
          f"`{what}` leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, but the"
          f" per-device state of {count} devices holds every device's block one after the"
          f" other along the first dimension (a multiple of {count}): build it with"
          " `jaxcomp.training.init_state(tx, params, mesh, axis_name)`, not"
          " `tx.init(params)`")


def check_per_device(opt_state: optax.OptState, like: optax.OptState, count: int,
                      what: str) -> None:
  """A clear error for a state not laid out per device for ``count`` devices.

  ``like``: one device's state (``jax.eval_shape`` of ``tx.init``).
  """
  check_layout(opt_state, count, what)
  leaves, treedef = jax.tree.flatten(opt_state)
  like_leaves, like_treedef = jax.tree.flatten(like)
  if treedef != like_treedef:
    raise ValueError(
        f"`{what}` has the structure {treedef}, but `tx.init` gives {like_treedef}: build it"
        " with `jaxcomp.training.init_state(tx, params, mesh, axis_name)` for this `tx`")
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(opt_state)]
  for path, leaf, local in zip(paths, leaves, like_leaves):
    want = per_device_shape(jnp.shape(local), count)
    if tuple(jnp.shape(leaf)) != want:
      stacked = tuple(jnp.shape(leaf)) == (count,) + tuple(jnp.shape(local))
      raise ValueError(
          f"`{what}` leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, but the"
          f" per-device state of {count} devices has {want} (each device's"
          f" {tuple(jnp.shape(local))} one after the other along the first dimension"
          + ("; a new leading device axis is not that layout" if stacked else "")
          + "): build it with `jaxcomp.training.init_state(tx, params, mesh, axis_name)`,"
          " not `tx.init(params)` or `jnp.stack`")


class PerDeviceState(NamedTuple):
  """State of :func:`per_device`: the wrapped transformation's state laid out per device.

  Attributes:
    jaxcomp_per_device: ``tx.init(params)`` in the per-device layout
      (:func:`tile_per_device`). The field's name is what ``jaxcomp.nnx``
      finds the per-device leaves by in an optimizer's state paths; optax's
      usual ``inner_state`` is also ``optax.masked``'s, whose state is not
      per device.
  """

  jaxcomp_per_device: optax.OptState


def per_device(
    tx: optax.GradientTransformation, mesh: Mesh, axis_name: checks.AxisName,
) -> optax.GradientTransformation:
  """``tx`` with its state held per device, for a hand-written ``shard_map`` step.

  ``init`` runs outside the mesh and lays ``tx.init(params)`` out per device,
  sharded over ``axis_name`` (:func:`init_state`'s layout); ``update`` runs
  inside ``jax.shard_map`` over ``axis_name`` with ``in_specs=P(axis_name)``
  for the state, where each device sees its own block, and hands ``tx`` that
  block as ``tx.init`` shaped it.

  Args:
    tx: an optax transformation holding jaxcomp compressors built over
      ``axis_name``, e.g. ``optax.chain(jaxcomp.gtopk(1e-2, "data"),
      optax.sgd(0.1))``.
    mesh: the mesh of the step.
    axis_name: its data axis, or a pair of axes.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`PerDeviceState`.

  Raises:
    ValueError: at the first trace, ``update`` sees a state that is not one
      device's block (it was called outside ``shard_map``, or the state was
      given with ``in_specs=P()``), naming the shape expected.

  Example::

    tx = training.per_device(optax.chain(jaxcomp.gtopk(1e-2, "data"), optax.sgd(0.1)),
                             mesh, "data")
    opt_state = tx.init(params)  # outside the mesh
    # inside jax.shard_map(..., in_specs=(P(), P("data"), P("data")), ...):
    updates, opt_state = tx.update(grads, opt_state, params)
  """
  mesh_axes(mesh, axis_name)
  if per_device_count(tx) is not None:
    raise TypeError("`tx` is already held per device: wrap the plain transformation once")
  count = num_replicas(mesh, axis_name)

  def init_fn(params):
    return PerDeviceState(init_state(tx, params, mesh, axis_name))

  def update_fn(updates, state, params=None):
    if protocol.searching():
      # No mesh and no per-device layout in a search (find_compressors): the
      # wrapped update runs on a state of its own, for its compressors to report.
      return tx.update(updates, tx.init(updates), params)[0], state
    like = jax.eval_shape(tx.init, updates)
    blocks = state.jaxcomp_per_device
    if not is_blocks_of(blocks, like):
      want = jax.eval_shape(local_to_blocks, like)
      for path, got, block in zip(
          [p for p, _ in jax.tree_util.tree_leaves_with_path(blocks)],
          jax.tree.leaves(blocks), jax.tree.leaves(want)):
        if jnp.shape(got) != block.shape:
          break
      else:
        path, got, block = (), blocks, want
      raise ValueError(
          f"the per-device state's leaf {jax.tree_util.keystr(path)} has shape"
          f" {jnp.shape(got)} here, but one device's block is {block.shape} (the state of"
          f" {count} devices holds every device's block one after the other along the"
          " first dimension): call `update` inside `jax.shard_map` over"
          f" {axis_name!r} with `in_specs=P({axis_name!r})` for the state (in Flax NNX,"
          f" inside a step wrapped by jaxcomp.nnx.data_parallel(mesh, {axis_name!r})), so"
          " that each device sees its own block, and build the state with this"
          " transformation's `init` (or `jaxcomp.training.init_state`)")
    with protocol.replicated_state(None):  # the state is each device's own here
      updates, inner = tx.update(updates, blocks_to_local(blocks, like), params)
    return updates, PerDeviceState(local_to_blocks(inner))

  update_fn.jaxcomp_per_device_count = count
  return optax.GradientTransformation(init_fn, update_fn)


def per_device_count(tx) -> Optional[int]:
  """The device count of a :func:`per_device` transformation, ``None`` for any other."""
  return getattr(getattr(tx, "update", None), "jaxcomp_per_device_count", None)


def device_rows(opt_state: optax.OptState, like: optax.OptState) -> optax.OptState:
  """A per-device state with every device's state on a row of a new leading axis.

  For inspection and tests: leaf ``[devices, *shape]`` where ``like`` (one
  device's state or its shapes, e.g. ``jax.eval_shape(tx.init, params)``)
  has ``shape``; row ``d`` is device ``d``'s state.
  """
  pairs = zip(jax.tree.leaves(opt_state), jax.tree.leaves(like))
  counts = [jnp.shape(x)[0] // (jnp.shape(l)[0] if jnp.ndim(l) else 1)
            for x, l in pairs if jnp.ndim(l) == 0 or jnp.shape(l)[0]]
  count = counts[0] if counts else 1
  return jax.tree.map(lambda x, l: jnp.reshape(x, (count,) + tuple(jnp.shape(l))),
                      opt_state, like)


def local_state(opt_state: optax.OptState, device: int, like: optax.OptState) -> optax.OptState:
  """Device ``device``'s state out of a per-device one (see :func:`device_rows`)."""
  return jax.tree.map(lambda x: x[device], device_rows(opt_state, like))


def check_replicas(tree: chex.ArrayTree, what: str = "tree") -> None:
  """Raises if a leaf held replicated has device copies that differ.

  Under ``shard_map(..., check_vma=False)`` an output spec of ``P()`` marks
  an array replicated without checking it: a per-device compressor state
  returned that way becomes one array whose device copies silently differ
  (reading, checkpointing or resharding it sees one device's copy). This
  compares the copies of every fully replicated leaf on the host: call it
  after a step (one transfer per replicated leaf and device).

  Raises:
    ValueError: naming the first such leaf and what to change.
  """
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(x, jax.Array) or not x.sharding.is_fully_replicated:
      continue
    shards = x.addressable_shards
    first = np.asarray(shards[0].data)
    for other in shards[1:]:
      if not np.array_equal(np.asarray(other.data), first, equal_nan=True):
        raise ValueError(
            f"{what}{jax.tree_util.keystr(path)} is held replicated, but its copy on"
            f" {other.device} differs from the one on {shards[0].device}: per-device"
            " state (a compressor's residuals, momenta, keys) must be held per device,"
            " sharded over the data axes (training.init_state and in_specs=P(axis) in"
            " shard_map, or jaxcomp.nnx.per_device for Flax NNX), not in_specs=P() with"
            " check_vma=False")
