"""FSDP: parameters sharded over the fast axis, a compressor over the slow axis on the shard.

On a mesh with a fast axis (inside a node) and a slow one (between nodes), each
device holds row blocks of the parameters (:func:`shard_params`, the shard of
:func:`jaxcomp.hierarchical`); the forward pass all-gathers them over the fast
axis, so autodiff returns the gradient of the shard already reduce-scattered,
and the compressor exchanges only the shard across the slow links.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import optax

from jaxcomp._src import fusion
from jaxcomp._src import hierarchical
from jaxcomp._src import layout
from jaxcomp._src import protocol
from jaxcomp._src import registry
from jaxcomp._src import steps
from jaxcomp._src import wire

shard_shapes = hierarchical.shard_shapes  # the shard FSDP and the hierarchy share


def shard_params(params: optax.Params, mesh: Mesh, fast_axis: str) -> optax.Params:
  """``params`` laid out for :func:`make_fsdp_step`: row blocks sharded over ``fast_axis``.

  Each leaf becomes its matrix view (``(rows, cols)``; a vector stays a
  vector, a scalar a vector of one), its rows padded with zeros to a multiple
  of the axis size ``X``, and is sharded over ``fast_axis`` on its first
  dimension (replicated over the other axes): device ``j`` of a node holds
  row block ``j``, the shard of :func:`shard_shapes`.
  """
  size = mesh.shape[fast_axis]
  # A zero-size leaf is replicated: the step returns it so (see layout.state_sharding).
  return jax.tree.map(
      lambda x: jax.device_put(hierarchical.row_blocks(jnp.asarray(x), size),
                               NamedSharding(mesh, PartitionSpec(
                                   fast_axis if math.prod(jnp.shape(x)) else None))), params)


def gather_params(sharded: optax.Params, like: optax.Params) -> optax.Params:
  """The whole parameters of :func:`shard_params`' layout, shaped like ``like``."""
  return jax.tree.map(lambda x, l: hierarchical.from_row_blocks(x, jnp.shape(l)), sharded, like)


def init_fsdp_state(
    tx: optax.GradientTransformation, params: optax.Params, mesh: Mesh,
    slow_axis: str, fast_axis: str,
) -> optax.OptState:
  """``tx.init`` of one device's shard of ``params``, laid out per device over both axes.

  Built outside the mesh from the shard shapes: each device then updates the
  state of its own row blocks (residuals, momenta sized to the shard).
  """
  shards = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        shard_shapes(params, mesh.shape[fast_axis]))
  registry.check_chain(tx, shards)
  return layout.tile_per_device(tx.init(shards), mesh, (slow_axis, fast_axis))


def sharded_body(
    loss_fn: steps.LossFn, tx: optax.GradientTransformation, whole: optax.Params,
    fast_axis: str, size: int, *, agree_over: tuple[str, ...], skip_nonfinite: bool,
    form: Optional[int] = None, has_aux: bool = False,
) -> Callable:
  """The per-device body of an FSDP step: ``body(shard, state, batch) -> (shard, state, metrics)``.

  Inside ``shard_map``: the shard's row blocks all-gathered over ``fast_axis``
  (``size`` devices) into parameters shaped like ``whole``, the gradient of
  the shard (reduce-scattered by autodiff) divided into the mean, and ``tx``'s
  update applied or skipped alike over ``agree_over``
  (:func:`jaxcomp._src.steps.guarded_update`).
  """

  def body(shard, state, batch):
    def local_loss(shard):
      blocks = jax.tree.map(lambda x: jax.lax.all_gather(x, fast_axis, tiled=True), shard)
      params = gather_params(blocks, whole)
      return loss_fn(params, batch) if has_aux else (loss_fn(params, batch), None)

    (loss, aux), grads = jax.value_and_grad(local_loss, has_aux=True)(shard)
    grads = jax.tree.map(lambda g: g / size, grads)
    new_shard, new_state, finite = steps.guarded_update(
        tx, grads, state, shard, skip_nonfinite=skip_nonfinite, agree_over=agree_over, form=form)
    metrics = {"loss": loss, "finite": finite}
    if has_aux:
      metrics["aux"] = aux
    return new_shard, new_state, metrics

  return body


def make_fsdp_step(
    loss_fn: steps.LossFn,
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

  Wire: :func:`fsdp_transfers`. A :class:`jaxcomp.training.FormedStep`:
  one program per form of the compressor's step.
  """
  axes = (slow_axis, fast_axis)
  whole = protocol.abstract(like)
  size = mesh.shape[fast_axis]
  shard_params_like = shard_shapes(whole, size)
  shard_like = jax.eval_shape(tx.init, shard_params_like)
  spec = PartitionSpec(axes)
  count = layout.num_replicas(mesh, axes)

  def build(form: Optional[int]) -> Callable:
    # Every device updates its own shard: the skip must be the same on all of them.
    body = sharded_body(loss_fn, tx, whole, fast_axis, size, agree_over=axes,
                        skip_nonfinite=skip_nonfinite, form=form)

    def per_device(shard, blocks, batch):
      state = layout.blocks_to_local(blocks, shard_like)
      new_shard, new_state, metrics = body(shard, state, batch)
      add_axis = lambda x: jnp.expand_dims(x, 0)
      return new_shard, layout.local_to_blocks(new_state), jax.tree.map(add_axis, metrics)

    sharded = jax.shard_map(
        per_device, mesh=mesh, in_specs=(PartitionSpec(fast_axis), spec, spec),
        out_specs=(PartitionSpec(fast_axis), spec, spec), check_vma=False)

    def step(params, opt_state, batch):
      layout.check_per_device(opt_state, shard_like, count, "opt_state")
      return sharded(params, opt_state, batch)

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())

  return steps.FormedStep(build, lambda args: steps.formed_spec(tx, shard_params_like))



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
  ``fast_axis`` (the dense transfers of :func:`jaxcomp.hierarchical`), the
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
  nested = hierarchical.hierarchical(compressor, fast_axis, size)
  # The parameters are gathered whole (dense), whatever the compressor's mean is.
  slow = tuple(t for t in wire.transfers(nested, params, mesh_shape, steps=steps)
               if t.axes != (fast_axis,))
  padded = size * fusion.Bucket.of(shard_shapes(params, size)).size
  return (hierarchical.dense_transfers(padded, fast_axis, size) + slow
          + (wire.transfer(wire.Kind.ALL_REDUCE, mesh_shape[slow_axis] * size, 4,
                           (slow_axis, fast_axis)),))
