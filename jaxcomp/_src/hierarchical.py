"""Hierarchical exchange: dense on the fast axis, any compressor on the slow one only.

On a mesh with a fast axis (NVLink inside a node, ICI inside a slice) of
``X`` devices and a slow one (Ethernet or DCN between them), compression pays
on the slow links only. :func:`hierarchical` wraps any jaxcomp compressor
built over the slow axis:

1. a dense reduce-scatter of the mean over the fast axis (f32, or 16 bits on
   the wire): device ``j`` of a node holds row block ``j`` of every leaf;
2. the compressor over the slow axis on that shard alone, its state (its
   residual, momentum, factors) sized to the shard, so each device
   compresses ``1/X`` of the gradient;
3. an all-gather over the fast axis back to whole leaves: dense, or for a
   compressor whose mean has a compact form (the low-rank methods'
   factors, :class:`jaxcomp.protocol.Message`), of that form, from which
   every device forms every shard's mean.

Shards are row blocks: a leaf of shape ``(d0, ..., dk)`` is viewed as the
matrix ``(d0 ... d(k-1), dk)``, its rows padded with zeros to a multiple of
``X`` and cut into ``X`` equal blocks; a vector is cut into ``X`` equal
pieces, a scalar is a vector of one. A low-rank method therefore factorises
each row block on its own: ``M = [M_1; ...; M_X]`` is sent as ``X``
independent rank-``r`` approximations ``M_j ~ P_j Q_j^T``, each over the slow
axis; the fast axis gathers the ``(P_j, Q_j)`` and every device forms all
``X`` products.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import checks
from jaxcomp._src import collectives
from jaxcomp._src import fusion
from jaxcomp._src import protocol
from jaxcomp._src import wire


class HierarchicalState(NamedTuple):
  """State of :func:`hierarchical`.

  Attributes:
    inner_state: the wrapped compressor's state for this device's shard (its
      residual is sized by the buckets of :func:`shard_shapes` of the
      parameters).
  """

  inner_state: optax.OptState


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
  if len(shape) == 0:
    return 1, 1
  if len(shape) == 1:
    return shape[0], 1
  return math.prod(shape[:-1]), shape[-1]


def _shard_shape(shape: tuple[int, ...], fast_size: int) -> tuple[int, ...]:
  rows, cols = _rows_cols(shape)
  block = -(-rows // fast_size)
  return (block,) if len(shape) < 2 else (block, cols)


def shard_shapes(params: optax.Params, fast_size: int) -> optax.Params:
  """``jax.ShapeDtypeStruct`` leaves of one device's row-block shard of ``params``."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(_shard_shape(tuple(jnp.shape(x)), fast_size), x.dtype),
      params)


def row_blocks(x: jax.Array, fast_size: int) -> jax.Array:
  """The leaf's matrix view (a vector for rank < 2), rows zero-padded to a multiple of ``X``.

  ``[X * block, cols]`` (``[X * block]`` for a vector or a scalar): row block
  ``j`` (rows ``j * block`` to ``(j + 1) * block - 1``) is device ``j``'s shard.
  """
  shape = tuple(x.shape)
  rows, cols = _rows_cols(shape)
  block = -(-rows // fast_size)
  view = x.reshape(rows, cols) if len(shape) >= 2 else x.reshape(rows)
  return jnp.pad(view, [(0, block * fast_size - rows)] + [(0, 0)] * (view.ndim - 1))


def from_row_blocks(blocked: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The inverse of :func:`row_blocks`: the padding dropped, ``shape`` restored."""
  rows, _ = _rows_cols(tuple(shape))
  return blocked[:rows].reshape(shape)


def _blocks(leaf: jax.Array, fast_size: int) -> jax.Array:
  """``f32[X, block * cols]``: :func:`row_blocks` of the leaf, one row per device."""
  return row_blocks(leaf.astype(jnp.float32), fast_size).reshape(fast_size, -1)


def _unblocks(blocks: jax.Array, like: jax.Array) -> jax.Array:
  """The inverse of :func:`_blocks`: ``[X, block * cols]`` back to ``like``'s shape and dtype."""
  _, cols = _rows_cols(tuple(like.shape))
  blocked = blocks.reshape((-1, cols) if like.ndim >= 2 else (-1,))
  return from_row_blocks(blocked, tuple(like.shape)).astype(like.dtype)


def hierarchical(
    compressor: optax.GradientTransformation,
    fast_axis: str,
    fast_size: int,
    *,
    fast_dtype: Any = None,
    fast_reduce: bool = True,
) -> optax.GradientTransformation:
  """Any compressor on the slow axis only, on this device's ``1/X`` of the gradient.

  Args:
    compressor: a jaxcomp compressor built over the slow axis (or axes),
      e.g. ``jaxcomp.gtopk(1e-3, "dcn")``. With its ``bucket_cap_mb``, the
      shard is cut into buckets of that many MiB (of the shard: ``X`` times
      as much gradient per bucket), each reduce-scattered, compressed and
      all-gathered after the one before.
    fast_axis: the fast mesh axis (inside a node or slice).
    fast_size: ``X``, its size (the state is built outside any mesh, so it
      is given here), an int >= 1.
    fast_dtype: ``None`` (f32) or a 16-bit float dtype for the dense
      reduce-scatter and all-gather on the fast axis (a low-rank
      compressor's factors are gathered in f32).
    fast_reduce: ``False`` when the input is already the same on every
      device of the fast axis (a DiLoCo replica group's pseudo-gradient,
      :func:`jaxcomp.training.make_diloco_step`): each device then takes its
      own shard of it, and no reduce-scatter is sent.

  Returns:
    An ``optax.GradientTransformation`` with state
    :class:`HierarchicalState`, whose ``update`` runs inside ``shard_map``
    over both axes and returns the mean over the whole mesh (the
    compressor's decoded mean of the fast-axis means), identical on every
    device. A non-finite mean leaves every shard's state as it was.

  Wire (:func:`jaxcomp.wire.expected_bytes` gives it per axis in
  ``by_axes``): on the fast axis, a reduce-scatter and an all-gather of the ``X S``
  padded shard elements, ``(X - 1) / X * X S * w`` bytes each (``w`` bytes
  per element: 4, or 2 with a 16-bit ``fast_dtype``), except that a
  low-rank compressor's all-gather is of its factors and dense leaves'
  mean, ``L`` f32 per shard (``r (m + n)`` per compressed ``m x n`` block,
  plus the dense elements), ``(X - 1) / X * X L * 4`` bytes; and for a
  compressor with state to protect an all-reduce of one int32 (whether every shard's
  step is kept, :func:`skip_flag`), ``2 (X - 1) / X * 4`` bytes; on the slow
  axis, the compressor's formula for gradients shaped like the shard
  (:func:`shard_shapes`). With buckets, all of it per bucket.

  Example::

    tx = optax.chain(
        jaxcomp.hierarchical(jaxcomp.gtopk(1e-3, "dcn"), "ici", 4),
        optax.sgd(0.1, momentum=0.9))
  """
  inner_spec = protocol.spec(compressor)
  if inner_spec is None or inner_spec.fused is None:
    raise TypeError(
        "`compressor` must be one jaxcomp compressor (jaxcomp.gtopk(...), ...), not a"
        f" hierarchical one nor another transformation, got {type(compressor).__name__}")
  fused = inner_spec.fused
  if not isinstance(fast_axis, str) or not fast_axis:
    raise TypeError(f"`fast_axis` must be a mesh axis name (str), got {fast_axis!r}")
  if fast_axis in inner_spec.axes:
    raise ValueError(
        f"`fast_axis` {fast_axis!r} is also the compressor's axis: build the compressor"
        f" over the slow axis only, got axes {inner_spec.axes}")
  fast_size = checks.check_number(fast_size, "fast_size", integer=True, low=1)
  fast_reduce = checks.check_bool(fast_reduce, "fast_reduce")
  wire_dtype = None
  if fast_dtype is not None:
    wire_dtype = jnp.dtype(fast_dtype)
    if not jnp.issubdtype(wire_dtype, jnp.floating) or wire_dtype.itemsize not in (2, 4):
      raise TypeError(f"`fast_dtype` must be None or a 16- or 32-bit float, got {fast_dtype!r}")
    wire_dtype = None if wire_dtype.itemsize == 4 else wire_dtype

  def init_fn(params):
    shards = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shard_shapes(params, fast_size))
    return HierarchicalState(inner_state=compressor.init(shards))

  def wire_cost(shapes, sizes, steps):
    fast = sizes[fast_axis]
    shard = shard_shapes(shapes, fast_size)
    fast_cost = ()
    for bucket in fused.plan(shard):
      scatter, gather = dense_transfers(fast * bucket.size, fast_axis, fast, wire_dtype)
      if fused.message is not None:
        gather = wire.transfer(wire.Kind.ALL_GATHER, fast,
                               fast * fused.message.size(bucket) * 4, (fast_axis,))
      fast_cost += (scatter, gather) if fast_reduce else (gather,)
    if not fused.propagates_nonfinite:
      fast_cost += (skip_flag(fast_axis, fast),)
    slow_sizes = {a: sizes[a] for a in inner_spec.axes}
    return fast_cost + inner_spec.wire(shard, slow_sizes, steps)

  spec = protocol.Spec(
      name=inner_spec.name,
      config={**inner_spec.config, "fast_axis": fast_axis, "fast_size": fast_size,
              **({} if fast_reduce else {"fast_reduce": False})},
      axes=inner_spec.axes + (fast_axis,), wire=wire_cost, form=inner_spec.form,
      state=inner_spec.state)

  def update_fn(updates, state, params=None, **extra_args):
    del params
    # In a search, the inner compressor is not traced: this spec prices it on the shard.
    if protocol.announce(spec, updates):
      return updates, state
    fusion.check_leaves(updates)
    (size,) = checks.axis_sizes((fast_axis,))
    if size != fast_size:
      raise ValueError(
          f"`fast_size` is {fast_size} but the mesh axis {fast_axis!r} has {size} devices")
    like = shard_shapes(updates, fast_size)
    if not fused.layout(like).size:  # nothing to exchange
      return updates, state
    leaves = jax.tree.leaves(updates)
    gathered_before = None

    def exchange(index, bucket, after, compress):
      """Bucket ``index``: reduce-scatter on the fast axis, the compressor, all-gather back."""
      nonlocal gathered_before
      del index, after  # ordered below, after the bucket before's all-gather
      blocks = [_blocks(leaves[i], fast_size) for i in bucket.leaves]
      widths = [b.shape[1] for b in blocks]
      stacked = jnp.concatenate(blocks, axis=1)
      if gathered_before is not None:
        # This bucket's reduce-scatter follows the last one's all-gather: no
        # combiner merges the buckets.
        stacked = stacked + collectives.order_token(gathered_before).astype(stacked.dtype)
      if fast_reduce:
        shard = collectives.reduce_scatter(stacked.reshape(-1), fast_axis, wire_dtype=wire_dtype)
        # The mean, scaled after the sum: on the shard, where the division fuses
        # into the compressor's first read (scaled before, it is a pass of its own
        # over the X-times larger buffer). An f32 sum of X gradients overflows
        # only beyond 3.4e38 / X, and a non-finite mean skips the step.
        shard = shard / fast_size
      else:
        shard = lax.dynamic_index_in_dim(stacked, lax.axis_index(fast_axis), keepdims=False)
      # The shard goes in and its mean comes out flat, in the compressor's order:
      # no tree of the shard's leaves to fuse again, no flat mean split into leaves
      # to be concatenated again.
      if fused.message is None:
        mean, out = compress(shard)
        gathered = collectives.allgather_chunks(mean, fast_axis, wire_dtype=wire_dtype)
        parts = _split(gathered.reshape(fast_size, -1), widths, axis=1)
      else:
        # A low-rank mean is gathered as its factors and every shard's products
        # formed here, read straight into the leaves: no n-sized concatenation
        # of products and no n-sized all-gather.
        message, out = compress(shard)
        gathered = collectives.allgather(message, fast_axis)
        means = jax.vmap(functools.partial(fused.message.decode, bucket))(gathered)
        parts = [m.reshape(fast_size, -1) for m in means]
      gathered_before = gathered
      return {i: _unblocks(part, leaves[i]) for i, part in zip(bucket.leaves, parts)}, out

    def agree(ok):
      # Each shard's slow group decides on its own shard; a step skipped on one
      # shard is skipped on all (one int32 on the fast axis, not a test of the mean).
      return lax.pmin(ok.astype(jnp.int32), fast_axis) > 0

    results, new_inner, _ = fused.update(like, state.inner_state, exchange,
                                         compact=fused.message is not None,
                                         form=extra_args.get(protocol.FORM), agree=agree)
    result = fusion.scatter_leaves(updates, {i: x for r in results for i, x in r.items()})
    return result, HierarchicalState(inner_state=new_inner)

  protocol.attach_spec(update_fn, spec)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dense_transfers(padded: int, fast_axis: str, fast_size: int,
                    wire_dtype: Any = None) -> tuple[wire.Transfer, wire.Transfer]:
  """The dense reduce-scatter and all-gather over the fast axis of one bucket's ``padded`` elements.

  ``padded = X S`` (``S``: the elements of the bucket's shards,
  :func:`shard_shapes`), f32 or ``wire_dtype`` (16 bits: the reduce-scatter
  is an all-to-all).
  """
  itemsize = 4 if wire_dtype is None else jnp.dtype(wire_dtype).itemsize
  scatter = wire.Kind.REDUCE_SCATTER if itemsize == 4 else wire.Kind.ALL_TO_ALL
  return (wire.transfer(scatter, fast_size, padded * itemsize, (fast_axis,)),
          wire.transfer(wire.Kind.ALL_GATHER, fast_size, padded * itemsize, (fast_axis,)))


def skip_flag(fast_axis: str, fast_size: int) -> wire.Transfer:
  """The int32 all-reduce over the fast axis by which every shard keeps or skips a step together."""
  return wire.transfer(wire.Kind.ALL_REDUCE, fast_size, 4, (fast_axis,))


def _split(x: jax.Array, widths, axis: int = 0) -> list[jax.Array]:
  out, offset = [], 0
  for w in widths:
    out.append(jax.lax.slice_in_dim(x, offset, offset + w, axis=axis))
    offset += w
  return out
