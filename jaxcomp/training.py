"""A data-parallel training step with per-device compressor state.

The compressors' state differs per device (error-feedback residuals, local
momenta), so it lives outside ``shard_map``, each leaf repeated once per device
along its first dimension and sharded over the data axes (a device's block is
its own state, shaped as ``tx.init`` made it; see :func:`tile_per_device`);
parameters are replicated; each device computes the gradient of its own shard
of the batch::

  mesh = training.make_mesh(8)                             # axis "data"
  tx = optax.chain(jaxcomp.gtopk(1e-3, "data"), optax.sgd(0.1))
  params = training.replicate(params, mesh)
  opt_state = training.init_state(tx, params, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data")
  params, opt_state, losses = step(params, opt_state, training.shard(batch, mesh, "data"))

The step skips itself on every device alike when the mean gradient is not
finite (parameters and state unchanged). To count skipped steps with
``optax.apply_if_finite`` instead, put it *after* the compressor,
``optax.chain(compressor, optax.apply_if_finite(optimizer, 5))``, and build
the step with ``skip_nonfinite=False`` (the step's own skip would also undo
its counters). Wrapped around the compressor, ``apply_if_finite`` tests each
device's local gradient, so one device's NaN sends that device down the skip
branch while the others wait in the collective for ever.

:func:`save_checkpoint` and :func:`restore_checkpoint` keep the whole state
(parameters, every device's residuals, momenta, factors, counters and keys)
with orbax; a run restored from step ``t`` goes on bit for bit as if it had
never stopped.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import optax

from jaxcomp import base
from jaxcomp import fusion
from jaxcomp import hierarchy
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import wire

# loss_fn(params, batch) -> scalar loss over this device's part of the batch.
LossFn = Callable[[optax.Params, Any], jax.Array]


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


def _spec(axis_name: base.AxisName) -> PartitionSpec:
  axes = base.check_axis_name(axis_name)
  return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def num_replicas(mesh: Mesh, axis_name: base.AxisName) -> int:
  """Devices along the data axes of ``mesh``."""
  return math.prod(mesh.shape[a] for a in base.check_axis_name(axis_name))


def replicate(tree: chex.ArrayTree, mesh: Mesh) -> chex.ArrayTree:
  """``tree`` placed whole on every device of ``mesh`` (parameters).

  Always a copy: :func:`make_step` donates the parameters, which must not
  delete the caller's own arrays (``device_put`` keeps the caller's buffer as
  one device's shard, whatever ``may_alias`` says).
  """
  copied = jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
  return jax.device_put(copied, NamedSharding(mesh, PartitionSpec()))


def shard(batch: chex.ArrayTree, mesh: Mesh, axis_name: base.AxisName) -> chex.ArrayTree:
  """``batch`` split along its leading axis, one part per device."""
  return jax.device_put(batch, NamedSharding(mesh, _spec(axis_name)))


def _state_sharding(mesh: Mesh, axis_name: base.AxisName, leaf) -> NamedSharding:
  """Per-device state is sharded over the data axes; a zero-size leaf is replicated.

  A step's zero-size outputs come back replicated (they hold nothing to
  shard), so the state goes in the same way and the step compiles once.
  """
  empty = math.prod(jnp.shape(leaf)) == 0
  return NamedSharding(mesh, PartitionSpec() if empty else _spec(axis_name))


def stack_per_device(tree: chex.ArrayTree, mesh: Mesh, axis_name: base.AxisName) -> chex.ArrayTree:
  """Each leaf copied once per device along a new leading axis, sharded over it.

  The layout of per-device data (gradients for :func:`make_update`); state
  takes :func:`tile_per_device`'s.
  """
  count = num_replicas(mesh, axis_name)
  return jax.tree.map(
      lambda x: jax.device_put(jnp.broadcast_to(x, (count,) + jnp.shape(x)),
                               _state_sharding(mesh, axis_name, x)), tree)


def per_device_shape(shape: Sequence[int], count: int) -> tuple[int, ...]:
  """The shape of a per-device leaf whose every one of ``count`` devices holds ``shape``.

  ``(count * d0, d1, ...)``: the devices' blocks one after the other along
  the first dimension; ``(count,)`` for a scalar.
  """
  shape = tuple(shape)
  return (count,) if not shape else (count * shape[0],) + shape[1:]


def tile_per_device(tree: chex.ArrayTree, mesh: Mesh, axis_name: base.AxisName) -> chex.ArrayTree:
  """Each leaf repeated once per device along its first dimension, sharded over it.

  The per-device state's layout (:func:`per_device_shape`): inside
  ``shard_map`` over ``axis_name`` a device's block is the leaf itself, a
  scalar's is ``[1]``. No axis is added, so a step updates each donated leaf
  in place (a new leading axis is read through a reshape, and XLA then
  copies every residual before writing it). A zero-size leaf is replicated.
  """
  count = num_replicas(mesh, axis_name)

  def tile(x):
    x = jnp.asarray(x)
    tiled = jnp.broadcast_to(x, (count,) + x.shape).reshape(per_device_shape(x.shape, count))
    return jax.device_put(tiled, _state_sharding(mesh, axis_name, x))

  return jax.tree.map(tile, tree)


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
    axis_name: base.AxisName,
) -> optax.OptState:
  """``tx.init(params)`` laid out per device (:func:`tile_per_device`), sharded over the data axes.

  ``init`` binds no mesh axis, so it runs here outside ``shard_map``; every
  device starts from the same state and the residuals diverge from step one.
  A chain that breaks what a compressor in it requires after it (momentum
  after :func:`jaxcomp.dgc`) is refused first (:func:`jaxcomp.check_chain`).
  """
  registry.check_chain(tx, params)
  return tile_per_device(tx.init(params), mesh, axis_name)


def _check_layout(opt_state: optax.OptState, count: int, what: str) -> None:
  """A clear error for a state that no per-device layout of ``count`` devices gives."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % count:
      raise ValueError(
          f"`{what}` leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, but the"
          f" per-device state of {count} devices holds every device's block one after the"
          f" other along the first dimension (a multiple of {count}): build it with"
          " `jaxcomp.training.init_state(tx, params, mesh, axis_name)`, not"
          " `tx.init(params)`")


def _check_per_device(opt_state: optax.OptState, like: optax.OptState, count: int,
                      what: str) -> None:
  """A clear error for a state not laid out per device for ``count`` devices.

  ``like``: one device's state (``jax.eval_shape`` of ``tx.init``).
  """
  _check_layout(opt_state, count, what)
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
      raise ValueError(
          f"`{what}` leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, but the"
          f" per-device state of {count} devices has {want} (each device's"
          f" {tuple(jnp.shape(local))} one after the other): build it with"
          " `jaxcomp.training.init_state(tx, params, mesh, axis_name)`, not"
          " `tx.init(params)`")


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


def _abstract(tree: chex.ArrayTree) -> chex.ArrayTree:
  """``jax.ShapeDtypeStruct`` leaves of ``tree`` (for ``jax.eval_shape`` of ``tx.init``)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


class _UpdateResult(tuple):
  """``(updates, opt_state)`` whose leaves flatten state first.

  ``jit`` hands a donated input's buffer to the first output of the same
  shape and dtype. An update shaped like a state leaf (a scalar's ``[devices]``,
  or any leaf's on a mesh of one device) would come first in
  ``(updates, opt_state)`` and take that leaf's buffer; the new state would be
  written elsewhere and copied back. Flattened state first, each state leaf
  is updated in its own buffer.
  """


jax.tree_util.register_pytree_node(
    _UpdateResult, lambda r: ((r[1], r[0]), None),
    lambda _, children: _UpdateResult((children[1], children[0])))


def make_update(
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name: base.AxisName,
    *,
    wrap: Optional[Callable[[Callable], Callable]] = None,
    donate: bool = False,
) -> Callable:
  """``tx.update`` alone, jitted over ``mesh``: ``update(grads, opt_state)``.

  For looking at a compressor without a model (tests, benchmarks): every
  device runs ``tx.update`` on its own row of the stacked gradients and on
  its own block of the per-device state.

  Args:
    tx: a compressor, or a chain that needs no ``params``.
    mesh: the device mesh.
    axis_name: the data axis, or a pair of axes for the 2D torus.
    wrap: applied to the per-device function before ``shard_map`` (for
      instance ``lambda f: chex.assert_max_traces(f, n=1)``).
    donate: donate the state's buffers (the residuals are updated in place,
      as inside :func:`make_step`).

  Returns:
    ``update(grads, opt_state) -> (updates, opt_state)``: ``grads`` and
    ``updates`` stacked per device (``[devices, ...]``, see
    :func:`stack_per_device`), each row of ``updates`` that device's result;
    ``opt_state`` laid out per device by :func:`init_state`.
  """
  spec = _spec(axis_name)

  def per_device(grads, blocks):
    grads = jax.tree.map(lambda x: x[0], grads)
    like = jax.eval_shape(tx.init, grads)
    # Gradients unlike the state's parameters: the blocks go in as they are,
    # for the transformation to name the mismatch (`updates`).
    state = (blocks_to_local(blocks, like) if is_blocks_of(blocks, like) else blocks)
    updates, state = tx.update(grads, state)
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), updates), local_to_blocks(state)

  body = per_device if wrap is None else wrap(per_device)
  # check_vma=False: see make_step.
  sharded = jax.shard_map(
      body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False)
  count = num_replicas(mesh, axis_name)

  def update(grads, opt_state):
    _check_layout(opt_state, count, "opt_state")
    return _UpdateResult(sharded(grads, opt_state))

  return jax.jit(update, donate_argnums=(1,) if donate else ())


def _guarded_update(tx, loss_fn, has_aux, skip_nonfinite):
  """The per-device body shared by the shard_map and pmap steps."""

  def body(params, state, batch):
    (loss, aux), grads = jax.value_and_grad(
        loss_fn if has_aux else lambda p, b: (loss_fn(p, b), None), has_aux=True
    )(params, batch)
    updates, new_state = tx.update(grads, state, params)
    # The mean gradient is identical on every device, so is this decision.
    # One reduction over the fused updates: one per leaf compiles in time
    # that grows with the square of the number of leaves.
    finite = protocol.all_finite(fusion.Bucket.of(updates).flatten(updates))
    new_params = optax.apply_updates(params, updates)
    if skip_nonfinite:
      new_params = protocol.keep_if(finite, new_params, params)
      new_state = protocol.keep_if(finite, new_state, state)
    metrics = {"loss": loss, "finite": finite}
    if has_aux:
      metrics["aux"] = aux
    return new_params, new_state, metrics

  return body


def make_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name: base.AxisName,
    *,
    has_aux: bool = False,
    donate: bool = True,
    skip_nonfinite: bool = True,
) -> Callable:
  """A jitted data-parallel step: ``step(params, opt_state, batch)``.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``), the mean over this device's shard of the batch.
    tx: usually ``optax.chain(compressor, optimizer)``, the compressor's
      ``axis_name`` the same as here.
    mesh: the device mesh.
    axis_name: the data axis, or a pair of axes for the 2D torus.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the parameter and state buffers to the step.
    skip_nonfinite: keep parameters and state unchanged, on every device
      alike, when the mean gradient is not finite. Set it to ``False`` when
      ``tx`` holds ``optax.apply_if_finite`` after the compressor, so that
      its counters of non-finite steps advance.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` with
    ``params`` replicated, ``opt_state`` laid out per device (see
    :func:`init_state`), ``batch`` sharded on its leading axis (see
    :func:`shard`), and ``metrics`` holding per-device ``loss`` and ``finite``
    with a leading device axis (no collective is spent on them).
  """
  spec = _spec(axis_name)
  body = _guarded_update(tx, loss_fn, has_aux, skip_nonfinite)

  def per_device(params, blocks, batch):
    state = blocks_to_local(blocks, jax.eval_shape(tx.init, params))
    params, state, metrics = body(params, state, batch)
    add_axis = lambda x: jnp.expand_dims(x, 0)
    return params, local_to_blocks(state), jax.tree.map(add_axis, metrics)

  sharded = jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(PartitionSpec(), spec, spec),
      out_specs=(PartitionSpec(), spec, spec),
      # The compressors' outputs are equal on every device by construction
      # (tests check it bit for bit); the type system cannot see that through
      # ppermute and all-to-all.
      check_vma=False,
  )
  count = num_replicas(mesh, axis_name)

  def step(params, opt_state, batch):
    _check_per_device(opt_state, jax.eval_shape(tx.init, _abstract(params)), count,
                      "opt_state")
    return sharded(params, opt_state, batch)

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def make_pmap_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    axis_name: str,
    *,
    has_aux: bool = False,
    devices: Optional[Sequence[jax.Device]] = None,
    skip_nonfinite: bool = True,
) -> Callable:
  """The same step through ``jax.pmap``: every argument has a leading device axis.

  Parameters and state are stacked per device with :func:`pmap_stack` and
  :func:`init_pmap_state`; the batch is reshaped to ``[devices, per_device, ...]``.

  Example::

    tx = optax.chain(jaxcomp.gtopk(0.01, "data"), optax.sgd(0.1))
    params_d = training.pmap_stack(params)
    state_d = training.init_pmap_state(tx, params)
    step = training.make_pmap_step(loss_fn, tx, "data")
    params_d, state_d, metrics = step(params_d, state_d, batch.reshape(8, -1, ...))
  """
  return jax.pmap(
      _guarded_update(tx, loss_fn, has_aux, skip_nonfinite),
      axis_name=axis_name, devices=devices,
  )


def pmap_stack(tree: chex.ArrayTree, devices: Optional[Sequence[jax.Device]] = None
               ) -> chex.ArrayTree:
  """``tree`` copied once per device along a new leading axis, one row on each device.

  What ``jax.pmap`` takes for replicated values (parameters): ``devices``
  defaults to ``jax.local_devices()``, as ``pmap`` does.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  mesh = Mesh(np.array(devices), ("devices",))
  return stack_per_device(tree, mesh, "devices")


def init_pmap_state(
    tx: optax.GradientTransformation, params: optax.Params,
    devices: Optional[Sequence[jax.Device]] = None,
) -> optax.OptState:
  """``tx.init(params)`` stacked per device for :func:`make_pmap_step` (see :func:`init_state`)."""
  registry.check_chain(tx, params)
  return pmap_stack(tx.init(params), devices)


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


# ------------------------------------------------------------------------ FSDP


def shard_params(params: optax.Params, mesh: Mesh, fast_axis: str) -> optax.Params:
  """``params`` laid out for :func:`make_fsdp_step`: row blocks sharded over ``fast_axis``.

  Each leaf becomes its matrix view (``(rows, cols)``; a vector stays a
  vector, a scalar a vector of one), its rows padded with zeros to a multiple
  of the axis size ``X``, and is sharded over ``fast_axis`` on its first
  dimension (replicated over the other axes): device ``j`` of a node holds
  row block ``j``, the shard of :func:`jaxcomp.hierarchy.shard_shapes`.
  """
  size = mesh.shape[fast_axis]
  # A zero-size leaf is replicated: the step returns it so (see _state_sharding).
  return jax.tree.map(
      lambda x: jax.device_put(hierarchy.row_blocks(jnp.asarray(x), size),
                               NamedSharding(mesh, PartitionSpec(
                                   fast_axis if math.prod(jnp.shape(x)) else None))), params)


def gather_params(sharded: optax.Params, like: optax.Params) -> optax.Params:
  """The whole parameters of :func:`shard_params`' layout, shaped like ``like``."""
  return jax.tree.map(lambda x, l: hierarchy.from_row_blocks(x, jnp.shape(l)), sharded, like)


def init_fsdp_state(
    tx: optax.GradientTransformation, params: optax.Params, mesh: Mesh,
    slow_axis: str, fast_axis: str,
) -> optax.OptState:
  """``tx.init`` of one device's shard of ``params``, laid out per device over both axes.

  Built outside the mesh from the shard shapes: each device then updates the
  state of its own row blocks (residuals, momenta sized to the shard).
  """
  shards = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        hierarchy.shard_shapes(params, mesh.shape[fast_axis]))
  registry.check_chain(tx, shards)
  return tile_per_device(tx.init(shards), mesh, (slow_axis, fast_axis))


def make_fsdp_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    slow_axis: str,
    fast_axis: str,
    like: optax.Params,
    *,
    donate: bool = True,
    skip_nonfinite: bool = True,
) -> Callable:
  """A jitted FSDP step: parameters sharded over the fast axis, ``tx`` over the slow one.

  Each device holds its row blocks of the parameters (:func:`shard_params`);
  the forward pass all-gathers them over ``fast_axis``, so autodiff returns
  the gradient of the shard already reduce-scattered over ``fast_axis``
  (summed over its devices; divided here into their mean); ``tx``, a chain
  whose compressor is built over ``slow_axis``, then exchanges only the
  shard across the slow links, and the update stays sharded.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> loss`` on whole parameters.
    tx: e.g. ``optax.chain(jaxcomp.gtopk(1e-3, slow_axis), optax.sgd(0.1))``.
    mesh: a mesh with both axes.
    slow_axis: the axis between nodes, where ``tx`` compresses.
    fast_axis: the axis inside a node, over which the parameters are sharded.
    like: the whole parameters (or their shapes), for the leaves' shapes.
    donate: donate the parameter and state buffers.
    skip_nonfinite: keep parameters and state unchanged on every device when
      any device's update is not finite.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` with
    ``params`` of :func:`shard_params`, ``opt_state`` of
    :func:`init_fsdp_state`, ``batch`` sharded over both axes.

  Wire: :func:`fsdp_transfers`.
  """
  axes = (slow_axis, fast_axis)
  whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), like)
  size = mesh.shape[fast_axis]
  shard_like = jax.eval_shape(tx.init, hierarchy.shard_shapes(whole, size))

  def per_device(shard, blocks, batch):
    state = blocks_to_local(blocks, shard_like)

    def local_loss(shard):
      blocks = jax.tree.map(lambda x: jax.lax.all_gather(x, fast_axis, tiled=True), shard)
      return loss_fn(gather_params(blocks, whole), batch)

    loss, grads = jax.value_and_grad(local_loss)(shard)
    grads = jax.tree.map(lambda g: g / size, grads)
    updates, new_state = tx.update(grads, state, shard)
    finite = protocol.all_finite(fusion.Bucket.of(updates).flatten(updates))
    # Every device's own shard: the skip must be the same on all of them.
    finite = jax.lax.pmin(finite.astype(jnp.int32), axes) > 0
    new_shard = optax.apply_updates(shard, updates)
    if skip_nonfinite:
      new_shard = protocol.keep_if(finite, new_shard, shard)
      new_state = protocol.keep_if(finite, new_state, state)
    add_axis = lambda x: jnp.expand_dims(x, 0)
    metrics = {"loss": loss, "finite": finite}
    return new_shard, local_to_blocks(new_state), jax.tree.map(add_axis, metrics)

  spec = PartitionSpec(axes)
  sharded = jax.shard_map(
      per_device, mesh=mesh, in_specs=(PartitionSpec(fast_axis), spec, spec),
      out_specs=(PartitionSpec(fast_axis), spec, spec), check_vma=False)
  count = num_replicas(mesh, axes)

  def step(params, opt_state, batch):
    _check_per_device(opt_state, shard_like, count, "opt_state")
    return sharded(params, opt_state, batch)

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


# ---------------------------------------------------------------- checkpoints

_REPLICAS_KEY = "jaxcomp_num_replicas"
_SHAPES_KEY = "jaxcomp_param_shapes"


def fsdp_transfers(
    compressor: optax.GradientTransformation,
    params: optax.Params,
    mesh_shape: dict[str, int],
    slow_axis: str,
    fast_axis: str,
    *,
    steps: Optional[int] = None,
) -> wire.WireCost:
  """What a step of :func:`make_fsdp_step` sends, by the formulas (pass to ``wire`` to tally).

  The gradient's reduce-scatter and the parameters' all-gather over
  ``fast_axis`` (:func:`jaxcomp.hierarchy.dense_transfers`), the
  compressor's formula for the shard over ``slow_axis`` (its transfers in
  ``jaxcomp.hierarchical(compressor, fast_axis, X)``), and the step's skip:
  one int32 all-reduce over both axes, in place of the hierarchy's flag
  over ``fast_axis``.

  Args:
    compressor: the jaxcomp compressor in the step's chain, built over
      ``slow_axis``.
    params: the whole parameters (or their shapes).
    mesh_shape: the mesh's axis sizes (``dict(mesh.shape)``).
    slow_axis, fast_axis: as given to :func:`make_fsdp_step`.
    steps: as in :func:`jaxcomp.wire.expected_bytes`.
  """
  size = mesh_shape[fast_axis]
  nested = hierarchy.hierarchical(compressor, fast_axis, size)
  # The parameters are gathered whole (dense), whatever the compressor's mean is.
  slow = tuple(t for t in wire.transfers(nested, params, mesh_shape, steps=steps)
               if t.axes != (fast_axis,))
  return (hierarchy.dense_transfers(params, fast_axis, size) + slow
          + (wire.transfer(wire.Kind.ALL_REDUCE, mesh_shape[slow_axis] * size, 4,
                           (slow_axis, fast_axis)),))


def _param_shapes(params: optax.Params) -> dict[str, list[int]]:
  return {jax.tree_util.keystr(path): list(jnp.shape(x))
          for path, x in jax.tree_util.tree_leaves_with_path(params)}


def _drop_empty(tree: chex.ArrayTree) -> chex.ArrayTree:
  """``tree`` with its zero-size leaves as ``None`` (orbax cannot write them; they hold nothing)."""
  return jax.tree.map(lambda x: None if math.prod(jnp.shape(x)) == 0 else x, tree)


def _refill_empty(restored: chex.ArrayTree, like: chex.ArrayTree, mesh: Mesh) -> chex.ArrayTree:
  """The inverse of :func:`_drop_empty`: ``like``'s zero-size leaves put back, replicated."""
  leaves, treedef = jax.tree.flatten(like)
  kept = iter(jax.tree.leaves(restored))
  replicated = NamedSharding(mesh, PartitionSpec())
  return treedef.unflatten([
      jax.device_put(jnp.zeros(jnp.shape(x), x.dtype), replicated)
      if math.prod(jnp.shape(x)) == 0 else next(kept) for x in leaves])


def _checkpointer():
  """orbax's checkpointer; orbax is an optional dependency (``jaxcomp[checkpoint]``)."""
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "checkpoints need orbax: pip install 'jaxcomp[checkpoint]'"
    ) from e
  return ocp.StandardCheckpointer()


def _num_blocks(opt_state: optax.OptState) -> int:
  """The devices a per-device state is laid out for (0 for a state with nothing to hold)."""
  for x in jax.tree.leaves(opt_state):
    if math.prod(x.shape):
      return x.shape[0] // x.sharding.shard_shape(x.shape)[0]
  return 0


def save_checkpoint(
    directory: Union[str, os.PathLike],
    params: optax.Params,
    opt_state: optax.OptState,
    step: int = 0,
) -> None:
  """Writes parameters, the per-device optimizer state and ``step`` with orbax.

  Blocks until the checkpoint is on disk, so that the step may donate the
  buffers right after. Parameters are identical on every device and are
  written once (checked first with :func:`check_replicas`: a copy that
  differs is an error, not a silent pick); the state is written whole, every
  device's row of it.

  Args:
    directory: a new directory (an existing one is an error, as in orbax).
    params: replicated parameters (see :func:`replicate`).
    opt_state: the per-device state of :func:`init_state` and the step.
    step: the number of steps taken, returned by :func:`restore_checkpoint`.
  """
  check_replicas(params, "params")
  check_replicas(opt_state, "opt_state")
  replicas = _num_blocks(opt_state)
  checkpointer = _checkpointer()
  checkpointer.save(
      os.fspath(os.path.abspath(directory)),
      {"params": _drop_empty(params), "opt_state": _drop_empty(opt_state), "step": int(step)},
      custom_metadata={_REPLICAS_KEY: replicas, _SHAPES_KEY: _param_shapes(params)},
  )
  checkpointer.wait_until_finished()


def restore_checkpoint(
    directory: Union[str, os.PathLike],
    params: optax.Params,
    opt_state: optax.OptState,
    mesh: Mesh,
    axis_name: base.AxisName,
    *,
    params_spec: PartitionSpec = PartitionSpec(),
) -> tuple[optax.Params, optax.OptState, int]:
  """Reads a checkpoint of :func:`save_checkpoint` onto ``mesh``.

  Args:
    directory: what :func:`save_checkpoint` wrote.
    params: parameters (or ``jax.ShapeDtypeStruct``s) of the same structure,
      shapes and dtypes; only their structure is read.
    opt_state: a state built by :func:`init_state` for ``mesh`` (or its
      shapes); only its structure is read.
    mesh: the mesh to place the restored arrays on.
    axis_name: the data axis, or the pair of axes, of the per-device state.
    params_spec: how the parameters are laid out on ``mesh``: replicated
      (the default), or ``PartitionSpec(fast_axis)`` for the FSDP layout of
      :func:`shard_params` (with ``axis_name=(slow_axis, fast_axis)``).

  Returns:
    ``(params, opt_state, step)``: parameters laid out by ``params_spec`` and
    the state laid out per device and sharded over ``axis_name``, as
    :func:`make_step` (or :func:`make_fsdp_step`) takes them.

  Raises:
    ValueError: the checkpoint holds per-device state for another number of
      devices than ``mesh`` has along ``axis_name`` (each device's residuals
      and momenta are its own, so they are not re-sharded: restore onto the
      device count the run was saved with), or parameters of other shapes
      than ``params`` (another layout: FSDP row blocks of another fast-axis
      size, or replicated against sharded).
  """
  path = os.fspath(os.path.abspath(directory))
  checkpointer = _checkpointer()
  metadata = checkpointer.metadata(path).custom_metadata
  saved_shapes = metadata.get(_SHAPES_KEY)
  if saved_shapes is not None:
    for leaf, shape in _param_shapes(params).items():
      if saved_shapes.get(leaf) != shape:
        raise ValueError(
            f"the checkpoint in {path} holds parameter {leaf} of shape"
            f" {saved_shapes.get(leaf)}, but `params` has {shape}: it was saved with"
            " another layout (FSDP row blocks of another fast-axis size, or replicated"
            " against sharded); restore it with the layout it was saved with")
  saved = metadata.get(_REPLICAS_KEY)
  replicas = num_replicas(mesh, axis_name)
  if jax.tree.leaves(opt_state) and saved != replicas:
    raise ValueError(
        f"the checkpoint in {path} holds per-device optimizer state for {saved}"
        f" devices, but the mesh has {replicas} devices along `axis_name`"
        f" {axis_name!r}: restore it onto {saved} devices (residuals and"
        " momenta belong to their device and are not re-sharded)"
    )

  def abstract(tree, spec):
    sharding = NamedSharding(mesh, spec)
    return _drop_empty(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=sharding), tree))

  target = {
      "params": abstract(params, params_spec),
      "opt_state": abstract(opt_state, _spec(axis_name)),
      "step": 0,
  }
  restored = checkpointer.restore(path, target)
  return (_refill_empty(restored["params"], params, mesh),
          _refill_empty(restored["opt_state"], opt_state, mesh), int(restored["step"]))


# ------------------------------------------------------- large-batch recipe
#
# Mikami et al. (arXiv:1811.05233) keep ImageNet/ResNet-50 accurate at
# mini-batches beyond 32K with two techniques beside their 2D-torus
# all-reduce: batch-size control (the global batch grows over training) and
# label smoothing.


class BatchSizeSchedule:
  """A piecewise-constant, growing global batch size: ``schedule(step) -> size``.

  Built by :func:`batch_size_schedule`. Attributes:
    boundaries: the steps at which each size starts, ascending, the first 0.
    sizes: the global batch size from each boundary on, strictly increasing.
  """

  def __init__(self, boundaries: tuple[int, ...], sizes: tuple[int, ...]):
    self.boundaries = boundaries
    self.sizes = sizes

  def __call__(self, step):
    """The global batch size at ``step``: a Python int, or an int32 array for a traced step.

    The traced form serves as part of an optax schedule
    (:func:`batch_scaled_learning_rate`), which optax calls with its count.
    """
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
      if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}")
      return self.sizes[int(np.searchsorted(self.boundaries, step, side="right")) - 1]
    index = jnp.searchsorted(jnp.asarray(self.boundaries), step, side="right") - 1
    return jnp.asarray(self.sizes, jnp.int32)[jnp.maximum(index, 0)]

  def examples(self, num_steps: int) -> int:
    """Examples the first ``num_steps`` steps draw (the sum of their batch sizes)."""
    num_steps = base.check_number(num_steps, "num_steps", integer=True, low=0)
    ends = self.boundaries[1:] + (max(num_steps, self.boundaries[-1]),)
    return sum(size * max(0, min(end, num_steps) - start)
               for start, end, size in zip(self.boundaries, ends, self.sizes))

  def __repr__(self) -> str:
    return f"BatchSizeSchedule({dict(zip(self.boundaries, self.sizes))})"


def batch_size_schedule(
    boundaries_and_sizes: dict[int, int], *, num_replicas: Optional[int] = None,
) -> BatchSizeSchedule:
  """Batch-size control: a global batch that grows at given steps.

  Mikami et al. grow the mini-batch during training, small while the loss
  landscape is sharp early on and large later, and report that it keeps
  large mini-batch training stable. The schedule is piecewise constant:
  ``{0: 256, 150: 512, 225: 1024}`` trains steps 0 to 149 on 256 examples,
  150 to 224 on 512 and 1024 from step 225 on. Each distinct size is one
  compile of the step (a new batch shape): :func:`compile_batch_sizes`
  builds them all ahead of time, and a jitted :func:`make_step` fed batches
  of the schedule's sizes traces once per size. The learning rate is left to
  the caller (:func:`batch_scaled_learning_rate` scales it with the batch).

  Args:
    boundaries_and_sizes: step -> global batch size from that step on; the
      steps are ints >= 0, step 0 among them; the sizes ints >= 1, strictly
      increasing with the step.
    num_replicas: if given, every size must be a multiple of it (each device
      takes an equal part; :func:`check_batch_sizes` checks against a mesh).

  Returns:
    a :class:`BatchSizeSchedule`, ``schedule(step) -> global batch size``.

  Example::

    sizes = training.batch_size_schedule({0: 256, 150: 512, 225: 1024})
    steps = training.compile_batch_sizes(step, params, opt_state, batch, sizes, mesh, "data")
    for i in range(300):
      params, opt_state, metrics = steps[sizes(i)](params, opt_state, next_batch(sizes(i)))

  References:
    Mikami et al., `Massively Distributed SGD: ImageNet/ResNet-50 Training in
    a Flash <https://arxiv.org/abs/1811.05233>`_, 2018
  """
  if not hasattr(boundaries_and_sizes, "items"):
    raise TypeError("`boundaries_and_sizes` must be a dict {step: global batch size}, got"
                    f" {boundaries_and_sizes!r}")
  if num_replicas is not None:
    num_replicas = base.check_number(num_replicas, "num_replicas", integer=True, low=1)
  pairs = sorted(
      (base.check_number(step, "boundaries_and_sizes step", integer=True, low=0),
       base.check_number(size, "boundaries_and_sizes size", integer=True, low=1))
      for step, size in boundaries_and_sizes.items())
  if not pairs or pairs[0][0] != 0:
    raise ValueError("`boundaries_and_sizes` must give the batch size at step 0, got"
                     f" {dict(boundaries_and_sizes)!r}")
  for (step, size), (next_step, next_size) in zip(pairs, pairs[1:]):
    if next_size <= size:
      raise ValueError(
          "`boundaries_and_sizes` sizes must grow strictly with the step (batch-size"
          f" control), got {size} at step {step} and {next_size} at step {next_step}")
  if num_replicas is not None:
    for step, size in pairs:
      if size % num_replicas:
        raise ValueError(
            f"`boundaries_and_sizes` size {size} (from step {step}) must be a multiple of"
            f" `num_replicas` {num_replicas}, so that each device takes an equal part")
  return BatchSizeSchedule(tuple(s for s, _ in pairs), tuple(b for _, b in pairs))


def check_batch_sizes(schedule: BatchSizeSchedule, mesh: Mesh,
                      axis_name: base.AxisName) -> None:
  """Raises a ``ValueError`` unless every size of ``schedule`` splits evenly over the data axes."""
  count = num_replicas(mesh, axis_name)
  for step, size in zip(schedule.boundaries, schedule.sizes):
    if size % count:
      raise ValueError(
          f"the batch-size schedule's size {size} (from step {step}) is not a multiple of"
          f" the {count} devices along `axis_name` {axis_name!r}: each device must take"
          " an equal part of the global batch")


def compile_batch_sizes(
    step: Callable,
    params: optax.Params,
    opt_state: optax.OptState,
    example_batch: chex.ArrayTree,
    schedule: BatchSizeSchedule,
    mesh: Mesh,
    axis_name: base.AxisName,
) -> dict[int, Any]:
  """``step`` compiled once per distinct global batch size of ``schedule``, ahead of time.

  Args:
    step: a step of :func:`make_step` (or :func:`make_fsdp_step`).
    params: the parameters as the step takes them (only shapes are read).
    opt_state: the per-device state as the step takes it (only shapes are read).
    example_batch: a batch of any size: every leaf's leading axis is the
      examples' axis, replaced by each size of the schedule.
    schedule: the sizes (:func:`batch_size_schedule`).
    mesh: the device mesh.
    axis_name: the data axes the batch is sharded over (as :func:`shard`).

  Returns:
    ``{size: compiled step}``, each taking a batch of ``size`` examples
    sharded with :func:`shard`.

  Raises:
    ValueError: a size is not a multiple of the devices along ``axis_name``.
  """
  check_batch_sizes(schedule, mesh, axis_name)
  sharding = NamedSharding(mesh, _spec(axis_name))

  def abstract(size):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size,) + tuple(jnp.shape(x))[1:], jnp.result_type(x),
                                       sharding=sharding), example_batch)

  return {size: step.lower(params, opt_state, abstract(size)).compile()
          for size in schedule.sizes}


def batch_scaled_learning_rate(
    learning_rate: Union[float, optax.Schedule],
    schedule: BatchSizeSchedule,
    base_batch_size: int,
) -> optax.Schedule:
  """The linear scaling rule on a growing batch: ``lr(t) * schedule(t) / base_batch_size``.

  Goyal et al. scale the learning rate with the global batch (a batch ``k``
  times larger takes a ``k`` times larger rate); applied at every step, the
  rate grows with the batch of :func:`batch_size_schedule`. The schedule is
  read at optax's count, which equals the step index unless steps were
  skipped (a skipped step does not advance it).

  Args:
    learning_rate: the rate (or an optax schedule) for ``base_batch_size``.
    schedule: the global batch sizes.
    base_batch_size: the batch ``learning_rate`` is meant for, an int >= 1.

  Returns:
    an ``optax.Schedule`` for ``optax.sgd`` and the other optimizers.

  References:
    Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>`_, 2017
  """
  base_batch_size = base.check_number(base_batch_size, "base_batch_size", integer=True, low=1)
  if not callable(learning_rate):
    learning_rate = base.check_number(learning_rate, "learning_rate")
  rate = learning_rate if callable(learning_rate) else (lambda count: learning_rate)
  return lambda count: rate(count) * schedule(count) / base_batch_size


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float) -> jax.Array:
  """Softmax cross-entropy against smoothed integer labels, per example.

  Label smoothing (Szegedy et al.; Mikami et al. use it against the
  generalisation loss of large mini-batches) trains against the target
  ``q = (1 - a) * one_hot(labels) + a / K`` over ``K`` classes, what
  ``optax.smooth_labels(one_hot, a)`` gives. Its cross-entropy is computed
  without the one-hot:

    ``-sum_k q_k log p_k = (1 - a) * (-log p_label) + a * mean_k(-log p_k)``

  with ``log p = log_softmax(logits)``; ``a = 0`` is the plain cross-entropy.

  Args:
    logits: ``[..., K]`` unnormalised log-probabilities.
    labels: ``[...]`` integer classes in ``[0, K)``.
    smoothing: ``a``, a number in ``[0, 1]``.

  Returns:
    ``[...]`` the loss of each example (take its mean for a batch loss).

  References:
    Mikami et al., `Massively Distributed SGD: ImageNet/ResNet-50 Training in
    a Flash <https://arxiv.org/abs/1811.05233>`_, 2018;
    Szegedy et al., `Rethinking the Inception Architecture for Computer
    Vision <https://arxiv.org/abs/1512.00567>`_, 2016
  """
  smoothing = base.check_number(smoothing, "smoothing", low=0.0, high=1.0)
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"`labels` must be integer classes, got dtype {labels.dtype}")
  if jnp.shape(labels) != jnp.shape(logits)[:-1]:
    raise ValueError(f"`labels` of shape {jnp.shape(labels)} must be `logits`' shape"
                     f" {jnp.shape(logits)} without its last (class) axis")
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  label_log_prob = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  return -(1.0 - smoothing) * label_log_prob - smoothing * jnp.mean(log_probs, axis=-1)
