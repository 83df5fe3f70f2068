"""Checkpoints of a data-parallel run: parameters and every device's state, with orbax.

:func:`save_checkpoint` and :func:`restore_checkpoint` keep the whole state
(parameters, every device's residuals, momenta, factors, counters and keys); a
run restored from step ``t`` on the device count it was saved with goes on bit
for bit as if it had never stopped.

Restored onto another number of devices (8 -> 4, 4 -> 8), the state is
redistributed so that the update not yet applied is kept. Every payload is
divided by the device count ``P`` before the sum, so device ``i``'s residual
``e_i`` reaches the update as ``e_i / P``: what the residuals still owe is
their mean over devices, ``sum_i e_i / P``, and the restored residuals keep
that mean (keeping their sum instead would double it from 8 devices to 4).
Old device ``i`` covers ``[i / P_old, (i + 1) / P_old)``, new device ``j``
covers ``[j / P_new, (j + 1) / P_new)`` and gets ``e'_j = sum_i W_ji e_i``
with ``W_ji = P_new |overlap|``: rows of ``W`` sum to 1 (a leaf equal on
every device stays so) and ``sum_j e'_j / P_new = sum_i e_i / P_old``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Union

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import layout

_REPLICAS_KEY = "jaxcomp_num_replicas"
_SHAPES_KEY = "jaxcomp_param_shapes"
_AXES_KEY = "jaxcomp_state_axes"
_BLOCKS_KEY = "jaxcomp_state_blocks"


def _param_shapes(params: optax.Params) -> dict[str, list[int]]:
  return {jax.tree_util.keystr(path): list(jnp.shape(x))
          for path, x in jax.tree_util.tree_leaves_with_path(params)}


def _blocks(opt_state: optax.OptState, count: int) -> dict[str, list[int]]:
  """Each leaf's block of a per-device state of ``count`` devices (one device's share)."""
  return {jax.tree_util.keystr(path): [jnp.shape(x)[0] // count, *jnp.shape(x)[1:]]
          for path, x in jax.tree_util.tree_leaves_with_path(opt_state)}


def _state_axes(opt_state: optax.OptState) -> dict[str, Any]:
  """The data axes a per-device state is sharded over, and its mesh's axis sizes.

  ``{"names": [...], "sizes": [...], "mesh": {name: size}}``: the axes of the
  first non-empty leaf's spec (``P(axes)`` on its first dimension, the layout
  of :func:`jaxcomp.training.init_state`), in order, with their sizes; and
  every axis of its mesh, since a jitted step's outputs leave the axes of
  size 1 out of that spec. A state sharded otherwise is one unnamed axis of
  its device count; a state with nothing to hold has no axes.
  """
  for x in jax.tree.leaves(opt_state):
    if math.prod(x.shape):
      count = x.shape[0] // x.sharding.shard_shape(x.shape)[0]
      spec = getattr(x.sharding, "spec", ())
      names = spec[0] if spec else None
      names = (names,) if isinstance(names, str) else tuple(names or ())
      sizes = [x.sharding.mesh.shape[a] for a in names]
      if math.prod(sizes) != count:
        return {"names": [None], "sizes": [count], "mesh": {}}
      return {"names": list(names), "sizes": sizes, "mesh": dict(x.sharding.mesh.shape)}
  return {"names": [], "sizes": [], "mesh": {}}


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


def _interval_weights(old: int, new: int) -> list[list[tuple[int, float]]]:
  """The map from ``old`` devices' per-device state to ``new`` devices': ``W``'s nonzeros.

  Old device ``i`` covers ``[i / old, (i + 1) / old)`` of the unit interval,
  new device ``j`` covers ``[j / new, (j + 1) / new)``, and
  ``W_ji = new * |overlap|``. Row ``j`` of the result lists ``(i, W_ji)`` for
  the old devices that new device ``j`` overlaps, in order. Every row sums to 1 and every
  column to ``new / old``, so ``e'_j = sum_i W_ji e_i`` keeps the mean:
  ``sum_j e'_j / new = sum_i e_i / old``. From 8 to 4 each new device takes
  the mean of two old ones; from 4 to 8 each old device is copied to two.
  """
  rows = []
  for j in range(new):
    # In units of 1 / (old * new): new device j covers [j * old, (j + 1) * old),
    # old device i covers [i * new, (i + 1) * new); W_ji = overlap / old.
    low, high = j * old, (j + 1) * old
    rows.append([(i, (min((i + 1) * new, high) - max(i * new, low)) / old)
                 for i in range(low // new, -(-high // new))])
  return rows


def _redistribute_rows(rows: np.ndarray, new: int, what: str = "leaf") -> np.ndarray:
  """One state leaf's device rows ``[old, columns, n]`` mapped to ``[new, columns, n]``.

  Row ``(i, c)`` is the state of the device at position ``i`` in column
  ``c``; the map runs down each column on its own (:func:`_interval_weights`).
  A leaf whose rows are bit for bit equal down each column (a count, a key,
  low-rank factors, an optimizer state after the compressor) is carried as
  it is. Any other floating leaf (error-feedback residuals, local momenta) is
  redistributed, summed in float64 and rounded once to its dtype: a new row
  copied from a single old one is that row bit for bit.

  Raises:
    ValueError: a leaf that differs between devices of a column is not
      floating (it cannot be averaged), naming ``what``.
  """
  bits = np.ascontiguousarray(rows).view(np.uint8)
  if (bits == bits[:1]).all():
    return np.broadcast_to(rows[:1], (new,) + rows.shape[1:])
  if not jnp.issubdtype(rows.dtype, jnp.floating):
    raise ValueError(
        f"{what} ({rows.dtype}) differs between devices and is not floating: it cannot be"
        f" redistributed from {rows.shape[0]} devices to {new}")
  wide = rows.astype(np.float64)
  return np.stack([functools.reduce(np.add, [w * wide[i] for i, w in sources])
                   for sources in _interval_weights(rows.shape[0], new)]).astype(rows.dtype)


def _grid(saved: dict[str, Any], mesh: Mesh, axes: tuple[str, ...]) -> tuple[int, int, int]:
  """``(old rows, new rows, columns)``: how the devices are lined up for the map.

  ``saved``: the checkpoint's :func:`_state_axes`. When the new data axes are
  a pair whose last (the fast axis of FSDP and :func:`jaxcomp.hierarchical`)
  keeps the saved state's last axis size, the map runs along the first axis
  within each column: under FSDP device ``(s, f)`` holds shard ``f``, and
  only devices of the same ``f`` hold the same coordinates. Otherwise all
  devices are one column, in row-major order.
  """
  old, new = math.prod(saved["sizes"]), math.prod(mesh.shape[a] for a in axes)
  columns = mesh.shape[axes[-1]]
  # A saved pair's last axis is known by its place; a single saved axis may be
  # the pair's last one with a first of size 1 left out of the spec (a jitted
  # step's outputs drop such axes), known by its name only.
  pair_last = len(saved["names"]) == 2 or saved["names"][-1:] == [axes[-1]]
  if len(axes) == 2 and pair_last and saved["sizes"][-1] == columns:
    return old // columns, new // columns, columns
  return old, new, 1


def save_checkpoint(
    directory: Union[str, os.PathLike],
    params: optax.Params,
    opt_state: optax.OptState,
    step: int = 0,
) -> None:
  """Writes parameters, the per-device optimizer state and ``step`` with orbax.

  Blocks until the checkpoint is on disk, so that the step may donate the
  buffers right after. Parameters are identical on every device and are
  written once (checked first with :func:`jaxcomp.training.check_replicas`: a copy that
  differs is an error, not a silent pick); the state is written whole, every
  device's row of it, with the names and sizes of the data axes it is
  sharded over (what :func:`restore_checkpoint` redistributes it by).

  Args:
    directory: a new directory (an existing one is an error, as in orbax).
    params: replicated parameters (see :func:`jaxcomp.training.replicate`), or
      FSDP row blocks (:func:`jaxcomp.training.shard_params`).
    opt_state: the per-device state of :func:`jaxcomp.training.init_state` and the step.
    step: the number of steps taken, returned by :func:`restore_checkpoint`.
  """
  layout.check_replicas(params, "params")
  layout.check_replicas(opt_state, "opt_state")
  axes = _state_axes(opt_state)
  count = math.prod(axes["sizes"])
  checkpointer = _checkpointer()
  checkpointer.save(
      os.fspath(os.path.abspath(directory)),
      {"params": _drop_empty(params), "opt_state": _drop_empty(opt_state), "step": int(step)},
      custom_metadata={
          _REPLICAS_KEY: count if axes["sizes"] else 0,
          _AXES_KEY: axes,
          _BLOCKS_KEY: _blocks(opt_state, count),
          _SHAPES_KEY: _param_shapes(params),
      },
  )
  checkpointer.wait_until_finished()


def restore_checkpoint(
    directory: Union[str, os.PathLike],
    params: optax.Params,
    opt_state: optax.OptState,
    mesh: Mesh,
    axis_name: checks.AxisName,
    *,
    params_spec: PartitionSpec = PartitionSpec(),
) -> tuple[optax.Params, optax.OptState, int]:
  """Reads a checkpoint of :func:`save_checkpoint` onto ``mesh``, of any device count.

  Onto as many devices as it was saved from, the state is carried as it is,
  each device's block to the device of the same row-major position (a ring
  of 8 onto a 2x4 torus): the run goes on bit for bit.

  Onto another count, the saved state is read to host memory and
  redistributed leaf by leaf. Leaves equal on every device (counts, keys,
  low-rank factors, the optimizer's state after the compressor) are carried
  as they are. The others (error-feedback residuals, DGC's local momenta)
  keep their mean over devices up to float32 rounding: every payload is
  divided by the device count ``P`` before the sum, so that mean is the
  update they still owe. Old device ``i`` covers ``[i / P_old, (i + 1) /
  P_old)``, new device ``j`` covers ``[j / P_new, (j + 1) / P_new)`` and gets
  ``sum_i W_ji e_i`` with ``W_ji = P_new |overlap|``: from 8 devices to 4 each
  new one holds the mean of two old ones, from 4 to 8 each old one is copied
  to two. When ``axis_name`` is a pair whose last axis keeps the size of the
  saved state's last data axis (FSDP or :func:`jaxcomp.hierarchical` on
  another number of nodes), the map runs along the first axis among the
  devices of each last-axis position, which hold the same shard; otherwise
  over all devices in row-major order. The parameters are carried:
  replicated, or FSDP row blocks over a fast axis of the saved size.

  Args:
    directory: what :func:`save_checkpoint` wrote.
    params: parameters (or ``jax.ShapeDtypeStruct``s) of the same structure,
      shapes and dtypes; only their structure is read.
    opt_state: a state built by :func:`jaxcomp.training.init_state` for ``mesh`` (or its
      shapes); only its structure is read.
    mesh: the mesh to place the restored arrays on.
    axis_name: the data axis, or the pair of axes, of the per-device state.
    params_spec: how the parameters are laid out on ``mesh``: replicated
      (the default), or ``PartitionSpec(fast_axis)`` for the FSDP layout of
      :func:`jaxcomp.training.shard_params` (with ``axis_name=(slow_axis, fast_axis)``).

  Returns:
    ``(params, opt_state, step)``: parameters laid out by ``params_spec`` and
    the state laid out per device and sharded over ``axis_name``, as
    :func:`jaxcomp.training.make_step` (or :func:`jaxcomp.training.make_fsdp_step`) takes them.

  Raises:
    ValueError: FSDP parameters and state saved for a fast axis of another
      size (each device's state is sized to its shard: restore onto a mesh
      whose fast axis has the saved size); parameters of other shapes than
      ``params`` (replicated against sharded); a state leaf whose one-device
      block differs from ``opt_state``'s (another transformation, or
      :func:`jaxcomp.hierarchical` with another fast-axis size); a state
      leaf that differs between devices and is not floating, onto another
      device count; a checkpoint written without the state's axis sizes,
      onto another device count.
  """
  path = os.fspath(os.path.abspath(directory))
  checkpointer = _checkpointer()
  metadata = checkpointer.metadata(path).custom_metadata
  axes = layout.mesh_axes(mesh, axis_name)
  count = layout.num_replicas(mesh, axes)
  saved_axes = metadata.get(_AXES_KEY)
  saved_count = (math.prod(saved_axes["sizes"]) if saved_axes
                 else metadata.get(_REPLICAS_KEY))

  # FSDP: the parameters' row blocks and the state are sized to the fast axis.
  for fast in (a for a in jax.tree.leaves(tuple(params_spec)) if a is not None):
    saved_fast = saved_axes["mesh"].get(fast) if saved_axes else None
    if saved_fast not in (None, mesh.shape[fast]):
      raise ValueError(
          f"the checkpoint in {path} holds FSDP parameters and state in row blocks for a"
          f" fast axis of {saved_fast} devices, but `mesh` has {mesh.shape[fast]} along"
          f" {fast!r}: every device's state is sized to its shard, so it is not"
          f" redistributed across shard sizes; restore it onto a mesh with {saved_fast}"
          f" devices along {fast!r} (any number along the slow axis)")
  saved_shapes = metadata.get(_SHAPES_KEY)
  if saved_shapes is not None:
    for leaf, shape in _param_shapes(params).items():
      if saved_shapes.get(leaf) != shape:
        raise ValueError(
            f"the checkpoint in {path} holds parameter {leaf} of shape"
            f" {saved_shapes.get(leaf)}, but `params` has {shape}: it was saved with"
            " another layout (FSDP row blocks of another fast-axis size, or replicated"
            " against sharded); restore it with the layout it was saved with")

  has_state = bool(jax.tree.leaves(opt_state))
  if has_state:
    layout.check_layout(opt_state, count, "opt_state")
    saved_blocks = metadata.get(_BLOCKS_KEY)
    for leaf, block in _blocks(opt_state, count).items():
      if saved_blocks is not None and saved_blocks.get(leaf) != block:
        raise ValueError(
            f"the checkpoint in {path} holds state leaf {leaf} with one device's block"
            f" of shape {saved_blocks.get(leaf)}, but `opt_state` has {block}: it was"
            " saved by another transformation, or by jaxcomp.hierarchical or FSDP with"
            " another fast-axis size; restore it with the transformation and fast-axis"
            " size it was saved with")
  elastic = has_state and saved_count != count
  if elastic and saved_axes is None:
    raise ValueError(
        f"the checkpoint in {path} holds per-device optimizer state for {saved_count}"
        f" devices, but the mesh has {count} devices along `axis_name` {axis_name!r}, and"
        " it was written without the state's axis sizes, which redistributing it needs:"
        f" restore it onto {saved_count} devices and save it again")

  def abstract(tree, sharding_of):
    return _drop_empty(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=sharding_of(x)),
        tree))

  params_sharding = NamedSharding(mesh, params_spec)
  state_target = abstract(opt_state, lambda x: NamedSharding(mesh, layout.axes_spec(axis_name)))
  if elastic:
    # The saved state whole, on one device, for the host to redistribute.
    host = SingleDeviceSharding(mesh.devices.flat[0])
    state_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (saved_count * (x.shape[0] // count),) + x.shape[1:], x.dtype, sharding=host),
        state_target)
  restored = checkpointer.restore(path, {
      "params": abstract(params, lambda x: params_sharding),
      "opt_state": state_target,
      "step": 0,
  })
  state = restored["opt_state"]
  if elastic:
    old_rows, new_rows, columns = _grid(saved_axes, mesh, axes)

    def move(path, x):
      rows = np.asarray(x).reshape(old_rows, columns, -1)
      moved = _redistribute_rows(rows, new_rows, f"state leaf {jax.tree_util.keystr(path)}")
      return jax.device_put(moved.reshape((count * (x.shape[0] // saved_count),) + x.shape[1:]),
                            layout.state_sharding(mesh, axis_name, x))

    state = jax.tree_util.tree_map_with_path(move, state)
  return (_refill_empty(restored["params"], params, mesh),
          _refill_empty(state, opt_state, mesh), int(restored["step"]))
