"""Checkpoints of a data-parallel run: parameters and every device's state, with orbax.

:func:`save_checkpoint` and :func:`restore_checkpoint` keep the whole state
(parameters, every device's residuals, momenta, factors, counters and keys); a
run restored from step ``t`` goes on bit for bit as if it had never stopped.
"""

from __future__ import annotations

import math
import os
from typing import Union

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import optax

from jaxcomp._src import checks
from jaxcomp._src import layout

_REPLICAS_KEY = "jaxcomp_num_replicas"
_SHAPES_KEY = "jaxcomp_param_shapes"


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
  written once (checked first with :func:`jaxcomp.training.check_replicas`: a copy that
  differs is an error, not a silent pick); the state is written whole, every
  device's row of it.

  Args:
    directory: a new directory (an existing one is an error, as in orbax).
    params: replicated parameters (see :func:`jaxcomp.training.replicate`).
    opt_state: the per-device state of :func:`jaxcomp.training.init_state` and the step.
    step: the number of steps taken, returned by :func:`restore_checkpoint`.
  """
  layout.check_replicas(params, "params")
  layout.check_replicas(opt_state, "opt_state")
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
    axis_name: checks.AxisName,
    *,
    params_spec: PartitionSpec = PartitionSpec(),
) -> tuple[optax.Params, optax.OptState, int]:
  """Reads a checkpoint of :func:`save_checkpoint` onto ``mesh``.

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
  replicas = layout.num_replicas(mesh, axis_name)
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
      "opt_state": abstract(opt_state, layout.axes_spec(axis_name)),
      "step": 0,
  }
  restored = checkpointer.restore(path, target)
  return (_refill_empty(restored["params"], params, mesh),
          _refill_empty(restored["opt_state"], opt_state, mesh), int(restored["step"]))
