"""Low-rank compressors: PowerSGD and ACP-SGD, and the matrix view they share.

Each gradient leaf of rank >= 2 is viewed as a matrix ``M`` of shape
``(prod(shape[:-1]), shape[-1])`` (an HWIO conv kernel as ``(H*W*I, O)``, a
dense kernel as it is) and sent as rank-``r`` factors ``P`` (rows x r) and
``Q`` (cols x r), ``M ~ P Q^T``. A leaf where low rank would not pay (rank 1,
or ``(rows + cols) * r * min_compression_rate > rows * cols``) is sent dense.
Every factor of every compressed leaf is fused into one flat buffer and the
dense leaves ride in the same buffer as the first factor, so a step runs one
fused mean all-reduce per factor (the 2D-torus all-reduce when
``axis_name`` is a pair).

Leaves of the same matrix shape are laid side by side and handled as one
batch (a transformer's repeated layers share a few shapes), so the number
of matrix products does not grow with the depth of the model. The factors'
columns of every leaf are orthonormalised in one zero-padded batch
(:meth:`MatrixView.columns`), so neither does the orthonormalisation.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
import functools
import itertools
import math
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import checks
from jaxcomp._src import fusion
from jaxcomp._src import protocol
from jaxcomp._src import wire


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  return math.prod(shape[:-1]), shape[-1]


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """The split of a gradient pytree into rank-``r`` matrices and dense leaves.

  Static (shapes only): built at trace time from the gradients, or from
  ``jax.ShapeDtypeStruct`` leaves by the wire formula.

  Attributes:
    rank: ``r``, the number of columns of every factor.
    groups: ``(count, rows, cols)`` per matrix shape, in the order their
      leaves lie in ``lowrank``; the leaves of one group are adjacent.
    lowrank: the compressed leaves, grouped by matrix shape.
    dense: every other leaf, in tree order.
  """

  rank: int
  groups: tuple[tuple[int, int, int], ...]
  lowrank: fusion.Bucket
  dense: fusion.Bucket

  @classmethod
  def of(cls, tree: chex.ArrayTree, rank: int, min_compression_rate: float) -> "MatrixView":
    """The view of ``tree``'s leaves for factors of ``rank`` columns."""

    def compressed(shape: tuple[int, ...]) -> bool:
      if len(shape) < 2:
        return False
      rows, cols = _matrix_shape(shape)
      return (rows + cols) * rank * min_compression_rate <= rows * cols

    leaves = jax.tree.leaves(tree)
    chosen = [i for i, x in enumerate(leaves) if compressed(tuple(x.shape))]
    chosen.sort(key=lambda i: _matrix_shape(tuple(leaves[i].shape)))  # stable
    groups = tuple(
        (len(list(members)), rows, cols)
        for (rows, cols), members in itertools.groupby(
            chosen, key=lambda i: _matrix_shape(tuple(leaves[i].shape)))
    )
    lowrank = fusion.Bucket(
        leaves=tuple(chosen),
        shapes=tuple(tuple(leaves[i].shape) for i in chosen),
        dtypes=tuple(jnp.dtype(leaves[i].dtype) for i in chosen),
    )
    return cls(rank, groups, lowrank, fusion.Bucket.of(tree, lambda s: not compressed(s)))

  @property
  def bucket(self) -> fusion.Bucket:
    """The compressed leaves, then the dense ones: the fused bucket's order."""
    return self.lowrank + self.dense

  @property
  def p_size(self) -> int:
    """Elements of all ``P`` factors (``sum rows * r``)."""
    return sum(g * rows * self.rank for g, rows, _ in self.groups)

  @property
  def q_size(self) -> int:
    """Elements of all ``Q`` factors (``sum cols * r``)."""
    return sum(g * cols * self.rank for g, _, cols in self.groups)

  def matrices(self, flat: jax.Array) -> list[jax.Array]:
    """The ``lowrank`` bucket as one ``[count, rows, cols]`` batch per group."""
    return _split(flat, [(g, rows, cols) for g, rows, cols in self.groups])

  def p_factors(self, flat: jax.Array) -> list[jax.Array]:
    """A flat ``P`` buffer as one ``[count, rows, r]`` batch per group."""
    return _split(flat, [(g, rows, self.rank) for g, rows, _ in self.groups])

  def q_factors(self, flat: jax.Array) -> list[jax.Array]:
    """A flat ``Q`` buffer as one ``[count, cols, r]`` batch per group."""
    return _split(flat, [(g, cols, self.rank) for g, _, cols in self.groups])

  def length(self, factors: str = "pq") -> int:
    """The longest column of the ``P`` (``"p"``), ``Q`` (``"q"``) or both (``"pq"``) factors."""
    return max((max(rows if "p" in factors else 0, cols if "q" in factors else 0)
                for _, rows, cols in self.groups), default=0)

  def columns(self, flat: jax.Array, factor: str, length: Optional[int] = None) -> jax.Array:
    """A flat ``P`` (``factor="p"``) or ``Q`` buffer as ``[leaves, r, L]``, zero-padded.

    One row per factor column, every compressed leaf in one batch (in the
    order of :attr:`lowrank`), so that column-wise work on every factor is
    one program over a small buffer. ``L`` is ``length``, by default the
    factor's longest column. Read by one gather whose indices come from
    iotas (no per-group pieces, no index constant of the buffer's size).
    """
    starts, lengths, offset = [], [], 0
    for g, rows, cols in self.groups:
      n = rows if factor == "p" else cols
      starts += [offset + k * n * self.rank for k in range(g)]
      lengths += [n] * g
      offset += g * n * self.rank
    shape = (len(starts), self.rank, length or self.length(factor))
    column = lax.broadcasted_iota(jnp.int32, shape, 1)
    position = lax.broadcasted_iota(jnp.int32, shape, 2)
    inside = position < jnp.asarray(lengths, jnp.int32)[:, None, None]
    index = jnp.asarray(starts, jnp.int32)[:, None, None] + position * self.rank + column
    values = flat.at[jnp.where(inside, index, 0)].get(mode="promise_in_bounds")
    return jnp.where(inside, values, 0.0)

  def uncolumns(self, columns: jax.Array, factor: str) -> jax.Array:
    """The flat ``P`` (``factor="p"``) or ``Q`` buffer of ``[leaves, r, L]`` columns."""
    parts, start = [], 0
    for g, rows, cols in self.groups:
      n = rows if factor == "p" else cols
      parts.append(jnp.swapaxes(columns[start:start + g, :, :n], -1, -2))
      start += g
    return _join(parts)


def _split(flat: jax.Array, shapes) -> list[jax.Array]:
  out, offset = [], 0
  for shape in shapes:
    size = math.prod(shape)
    out.append(flat[offset:offset + size].reshape(shape))
    offset += size
  return out


def _join(batches) -> jax.Array:
  parts = [b.reshape(-1) for b in batches]
  if not parts:
    return jnp.zeros((0,), jnp.float32)
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _orthonormalize(columns: jax.Array) -> jax.Array:
  """Modified Gram-Schmidt on each ``[r, L]`` matrix of a ``[B, r, L]`` batch, row by row.

  Row ``i`` (a factor's column ``i``, see :meth:`MatrixView.columns`) loses
  its projections on the rows before it, then is scaled to norm 1. Every
  factor of every leaf goes through one batch: the program holds ``r``
  rounds of reductions, not ``r`` per matrix shape. Zero padding at the end
  of a row changes no projection and no norm, and stays zero.

  Deterministic (the same program on the same input gives the same bits on
  every device). A row that is exactly zero after the projections stays
  zero instead of dividing by zero; NaN stays NaN (poison survives).
  """
  rows = []
  for i in range(columns.shape[-2]):
    row = columns[..., i, :]
    for prev in rows:
      row = row - jnp.sum(prev * row, axis=-1, keepdims=True) * prev
    norm = jnp.sqrt(jnp.sum(row * row, axis=-1, keepdims=True))
    rows.append(row / jnp.where(norm == 0, 1.0, norm))
  return jnp.stack(rows, axis=-2)


def _refill(new: jax.Array, old: jax.Array) -> jax.Array:
  """``new`` (``[B, r, L]`` columns), with each all-zero factor column replaced by ``old``'s.

  A factor column is zero when its leaf's gradient was zero; warm-starting
  from it would keep the column zero for ever (``M 0 = 0``).
  """
  return jnp.where(jnp.all(new == 0, axis=-1, keepdims=True), old, new)


def _products(p_factors, q_factors) -> list[jax.Array]:
  """``P Q^T`` of every compressed leaf, ``[rows, cols]`` each, in the order of :attr:`MatrixView.lowrank`.

  One product per leaf, not per group: each is written straight into its
  leaf of the result or of the residual, where a group's product (and their
  concatenation) would be n-sized buffers to copy from, fresh every step.
  """
  return [jnp.einsum("mr,nr->mn", p[i], q[i])
          for p, q in zip(p_factors, q_factors) for i in range(p.shape[0])]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_factors(view: MatrixView, seed: int) -> tuple[jax.Array, jax.Array]:
  """Orthonormal Gaussian ``P`` and ``Q`` buffers drawn from ``seed`` (same on every device)."""
  key_p, key_q = jax.random.split(jax.random.key(seed))
  p = jax.random.normal(key_p, (view.p_size,), jnp.float32)
  q = jax.random.normal(key_q, (view.q_size,), jnp.float32)
  return (view.uncolumns(_orthonormalize(view.columns(p, "p")), "p"),
          view.uncolumns(_orthonormalize(view.columns(q, "q")), "q"))


def _check_rank(rank) -> int:
  return checks.check_number(rank, "rank", integer=True, low=1)


def _check_min_compression_rate(rate) -> float:
  return checks.check_number(rate, "min_compression_rate", low=1.0)


def _layout(rank: int, min_compression_rate: float):
  """The bucket order of both methods: the compressed leaves by matrix shape, then the dense ones."""
  return lambda tree: MatrixView.of(tree, rank, min_compression_rate).bucket


def _view_of(bucket: fusion.Bucket, rank: int, min_compression_rate: float) -> MatrixView:
  """The :class:`MatrixView` of a bucket laid out by :func:`_layout` (positions: bucket order)."""
  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in zip(bucket.shapes, bucket.dtypes)]
  return MatrixView.of(shapes, rank, min_compression_rate)


def _mean_of(view: MatrixView, p: jax.Array, q: jax.Array, dense_mean: jax.Array) -> list:
  """The mean per bucket leaf from the mean's flat ``P`` and ``Q`` buffers and the dense
  leaves' mean: the low-rank products, then the dense leaves' slices."""
  return _products(view.p_factors(p), view.q_factors(q)) + view.dense.split(dense_mean)


def _message(rank: int, min_compression_rate: float) -> protocol.Message:
  """Both methods' mean as its factors: ``f32[p_size + q_size + dense.size]``, ``[P, Q, dense]``.

  A caller that gathers the means of many shards (:func:`jaxcomp.hierarchical`)
  gathers these instead, a ``rank (m + n) / (m n)`` share of each compressed
  leaf, and forms each shard's ``P Q^T`` itself.
  """

  def size(bucket: fusion.Bucket) -> int:
    view = _view_of(bucket, rank, min_compression_rate)
    return view.p_size + view.q_size + view.dense.size

  def decode(bucket: fusion.Bucket, message: jax.Array) -> list:
    view = _view_of(bucket, rank, min_compression_rate)
    p, q, dense_mean = jnp.split(message, [view.p_size, view.p_size + view.q_size])
    return _mean_of(view, p, q, dense_mean)

  return protocol.Message(size, decode)


def _leaf_residuals(view: MatrixView, corrected: jax.Array, sent) -> list:
  """``corrected - sent`` per compressed leaf; the dense leaves' residual stays (zero)."""
  lowrank = corrected[:view.lowrank.size]
  kept = [c - s.reshape(c.shape) for c, s in zip(view.lowrank.split(lowrank), sent)]
  return kept + [None] * len(view.dense.leaves)


# -------------------------------------------------------------------- PowerSGD


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd`.

  Attributes:
    count: steps taken (int32, saturating).
    residual: f32 pytree like the parameters, this device's error feedback
      (zero on the leaves sent dense).
    q: f32 flat buffer of every compressed leaf's ``Q`` factor (the reduced
      one of the last step, identical on every device), the warm start.
    rng_key: raw ``uint32`` key, identical on every device (never folded with
      the device index); draws a fresh ``Q`` each step when ``warm_start`` is
      off.
  """

  count: jax.Array
  residual: optax.Params
  q: jax.Array
  rng_key: jax.Array


def powersgd(
    rank: int,
    axis_name: checks.AxisName,
    min_compression_rate: float = 2.0,
    *,
    warm_start: bool = True,
    seed: int = 0,
) -> optax.GradientTransformation:
  """PowerSGD: rank-``r`` power iteration with error feedback.

  With ``M = g + e`` this device's corrected gradient matrix, one step of
  subspace iteration on the mean of the ``M``'s, warm-started from the last
  step's ``Q``::

    P_i = M_i Q                     P = mean_i P_i      (all-reduce)
    P^ = orthonormalise(P)          (Gram-Schmidt, on every device alike)
    Q_i = M_i^T P^                  Q = mean_i Q_i      (all-reduce)
    update = P^ Q^T                 e_i' = M_i - P^ Q_i^T

  ``P^ Q_i^T`` is what this device contributed, so ``mean_i`` of what was
  sent plus the new residuals is the mean of the corrected gradients (mass
  conservation, up to float rounding). ``Q`` starts Gaussian from ``seed`` and
  orthonormal, the same on every device. A leaf whose gradient is zero keeps
  its previous ``Q`` columns, so a zero step does not stall it for ever.

  Leaves of rank 1, and matrices with ``(rows + cols) * rank *
  min_compression_rate > rows * cols``, are sent dense in the same fused
  buffer as ``P``; their residual stays zero.

  Args:
    rank: ``r >= 1``, columns of the factors.
    axis_name: the data-parallel mesh axis, or a pair ``(row_axis, col_axis)``
      for the 2D torus.
    min_compression_rate: ``>= 1``; a matrix is compressed only when its
      factors are at least this many times smaller than it.
    warm_start: carry ``Q`` across steps (the paper's choice); otherwise
      draw a fresh Gaussian ``Q`` each step from the state's key.
    seed: ``[0, 2**32)``, the key of the first ``Q``.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` returns the
    low-rank approximation of the mean gradient (dense mean for the dense
    leaves), identical on every device, in the dtype of ``updates``. State:
    :class:`PowerSGDState`.

  Wire: two fused mean all-reduces per step, of
  ``sum r * rows`` (plus the dense leaves) and ``sum r * cols`` f32: ring
  all-reduces, ``2 (P - 1) / P * 4 (r (rows + cols) + n_dense)`` bytes per
  device; on a torus each is a reduce-scatter, all-reduce and all-gather.

  Example::

    tx = optax.chain(jaxcomp.powersgd(4, "data"), optax.sgd(0.1, momentum=0.9))

  References:
    Vogels et al., `PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization <https://arxiv.org/abs/1905.13727>`_, NeurIPS 2019.
  """
  rank = _check_rank(rank)
  axes = checks.check_axis_name(axis_name)
  min_compression_rate = _check_min_compression_rate(min_compression_rate)
  warm_start = checks.check_bool(warm_start, "warm_start")
  seed = checks.check_seed(seed)

  def init(params, bucket):
    _, q = _init_factors(_view_of(bucket, rank, min_compression_rate), seed)
    return {"q": q, "rng_key": checks.raw_key(seed)}  # the key stays put with a warm start

  def step(ctx, corrected, state):
    view = _view_of(ctx.bucket, rank, min_compression_rate)
    q_start = state.q
    if not warm_start:
      q_start = jax.random.normal(ctx.key, (view.q_size,), jnp.float32)
    matrices = view.matrices(corrected[:view.lowrank.size])
    local_p = [jnp.einsum("gmn,gnr->gmr", m, q)
               for m, q in zip(matrices, view.q_factors(q_start))]
    reduced = ctx.mean(jnp.concatenate([_join(local_p), corrected[view.lowrank.size:]]))
    p_flat = view.uncolumns(_orthonormalize(view.columns(reduced[:view.p_size], "p")), "p")
    p_hat = view.p_factors(p_flat)
    local_q = [jnp.einsum("gmn,gmr->gnr", m, p) for m, p in zip(matrices, p_hat)]
    q_mean = ctx.mean(_join(local_q))
    sent = _products(p_hat, local_q)
    new_q = view.uncolumns(
        _refill(view.columns(q_mean, "q"), view.columns(q_start, "q")), "q")
    dense_mean = reduced[view.p_size:]
    return protocol.Output(
        mean=_mean_of(view, p_flat, q_mean, dense_mean),
        residual=_leaf_residuals(view, corrected, sent),
        state={"q": new_q},
        witness=(reduced, q_mean),
        message=jnp.concatenate([p_flat, q_mean, dense_mean]))

  def wire_cost(bucket, sizes, steps):
    del steps
    view = _view_of(bucket, rank, min_compression_rate)
    return wire.mean(view.p_size + view.dense.size, sizes) + wire.mean(view.q_size, sizes)

  return protocol.compressor(protocol.Method(
      name="powersgd",
      config=dict(rank=rank, axis_name=axis_name, min_compression_rate=min_compression_rate,
                  warm_start=warm_start, seed=seed),
      axes=axes, state=PowerSGDState, step=step, wire=wire_cost, init=init,
      layout=_layout(rank, min_compression_rate), error_feedback=True,
      seed=None if warm_start else seed, linear_payload=True,
      message=_message(rank, min_compression_rate)))


# --------------------------------------------------------------------- ACP-SGD


class ACPSGDState(NamedTuple):
  """State of :func:`acpsgd`.

  Attributes:
    count: steps taken (int32, saturating); its parity picks the factor.
    residual: f32 pytree like the parameters, this device's error feedback
      (zero on the leaves sent dense).
    p: f32 flat buffer of the orthonormal ``P`` factors of the last even
      step, identical on every device (used by the next odd step).
    q: f32 flat buffer of the orthonormal ``Q`` factors of the last odd step
      (or the initial ones), identical on every device.
  """

  count: jax.Array
  residual: optax.Params
  p: jax.Array
  q: jax.Array


def acpsgd(
    rank: int,
    axis_name: checks.AxisName,
    min_compression_rate: float = 2.0,
    *,
    seed: int = 0,
) -> optax.GradientTransformation:
  """ACP-SGD: alternate low-rank compression, one factor per step.

  With ``M_i = g_i + e_i`` this device's corrected gradient matrix and
  ``P^``, ``Q^`` the orthonormal factors carried from earlier steps::

    even step:  P_i = M_i Q^    P = mean_i P_i   update = P Q^^T
                e_i' = M_i - P_i Q^^T            P^ <- orthonormalise(P)
    odd step:   Q_i = M_i^T P^  Q = mean_i Q_i   update = P^ Q^T
                e_i' = M_i - P^ Q_i^T            Q^ <- orthonormalise(Q)

  Each step is one power-iteration half-step; the alternation replaces
  PowerSGD's two all-reduces per step by one, half its traffic, and the
  factors' orthonormalisation moves off the critical path (the paper's
  point). Both branches live in one compiled program (a ``lax.switch`` on
  the parity of ``count``, the same on every device: branch 0 the P step,
  branch 1 the Q step); a branch holds the product and the all-reduce, and
  the one orthonormalisation runs after it. Error feedback as in
  :func:`powersgd`; ``P^`` and ``Q^`` start Gaussian from ``seed``,
  orthonormal. A factor column that comes back zero (a zero gradient) keeps
  its previous value before the orthonormalisation.

  Matrices that would not pay (see :func:`powersgd`) and rank-1 leaves are
  sent dense, fused into the step's one buffer.

  Args:
    rank: ``r >= 1``, columns of the factors.
    axis_name: the data-parallel mesh axis, or a pair ``(row_axis, col_axis)``
      for the 2D torus.
    min_compression_rate: ``>= 1``; a matrix is compressed only when its two
      factors are at least this many times smaller than it.
    seed: ``[0, 2**32)``, the key of the first factors (same on every device).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` returns the low-rank
    mean gradient, identical on every device, in the dtype of ``updates``.
    State: :class:`ACPSGDState`.

  Wire: one fused mean all-reduce per step: on even steps of
  ``sum r * rows + n_dense`` f32, on odd steps of ``sum r * cols + n_dense``
  (a ring all-reduce, ``2 (P - 1) / P * 4 s`` bytes; on a torus a
  reduce-scatter, all-reduce and all-gather). The wire formula weights each
  branch 1/2.

  Example::

    tx = optax.chain(jaxcomp.acpsgd(4, "data"), optax.sgd(0.1, momentum=0.9))

  References:
    Zhang et al., `Evaluation and Optimization of Gradient Compression for
    Distributed Deep Learning <https://arxiv.org/abs/2306.08881>`_, ICDCS 2023.
  """
  rank = _check_rank(rank)
  axes = checks.check_axis_name(axis_name)
  min_compression_rate = _check_min_compression_rate(min_compression_rate)
  seed = checks.check_seed(seed)

  def init(params, bucket):
    p, q = _init_factors(_view_of(bucket, rank, min_compression_rate), seed)
    return {"p": p, "q": q}

  def step(ctx, corrected, state):
    view = _view_of(ctx.bucket, rank, min_compression_rate)
    dense = corrected[view.lowrank.size:]
    length = view.length()  # P and Q columns share one batch shape

    # The branches hold the product and the exchange only, and return
    # factors: (P, Q) of the mean and of this device's contribution, and the
    # reduced factor and its old value as columns. The n-sized products and
    # the one orthonormalisation are made once, after the switch (a
    # branch's n-sized outputs would be fresh buffers, copied from, and a
    # branch's own program compiles slowly).
    def p_step(matrices):
      local = [jnp.einsum("gmn,gnr->gmr", m, q)
               for m, q in zip(matrices, view.q_factors(state.q))]
      reduced = ctx.mean(jnp.concatenate([_join(local), dense]))
      p_mean = reduced[:view.p_size]
      return (p_mean, state.q, _join(local), state.q, reduced[view.p_size:],
              view.columns(p_mean, "p", length), view.columns(state.p, "p", length))

    def q_step(matrices):
      local = [jnp.einsum("gmn,gmr->gnr", m, p)
               for m, p in zip(matrices, view.p_factors(state.p))]
      reduced = ctx.mean(jnp.concatenate([_join(local), dense]))
      q_mean = reduced[:view.q_size]
      return (state.p, q_mean, state.p, _join(local), reduced[view.q_size:],
              view.columns(q_mean, "q", length), view.columns(state.q, "q", length))

    even = ctx.count % 2 == 0
    p_mean, q_mean, p_sent, q_sent, dense_mean, fresh, old = ctx.switch(
        ctx.count % 2, (p_step, q_step), view.matrices(corrected[:view.lowrank.size]))
    ortho = _orthonormalize(_refill(fresh, old))
    new_p = jnp.where(even, view.uncolumns(ortho, "p"), state.p)
    new_q = jnp.where(even, state.q, view.uncolumns(ortho, "q"))
    sent = _products(view.p_factors(p_sent), view.q_factors(q_sent))
    return protocol.Output(
        mean=_mean_of(view, p_mean, q_mean, dense_mean),
        residual=_leaf_residuals(view, corrected, sent),
        state={"p": new_p, "q": new_q},
        witness=(p_mean, q_mean, dense_mean),
        message=jnp.concatenate([p_mean, q_mean, dense_mean]))

  def wire_cost(bucket, sizes, steps):
    del steps
    view = _view_of(bucket, rank, min_compression_rate)
    return (wire.in_branch(wire.mean(view.p_size + view.dense.size, sizes), 0, Fraction(1, 2))
            + wire.in_branch(wire.mean(view.q_size + view.dense.size, sizes), 1, Fraction(1, 2)))

  return protocol.compressor(protocol.Method(
      name="acpsgd",
      config=dict(rank=rank, axis_name=axis_name, min_compression_rate=min_compression_rate,
                  seed=seed),
      axes=axes, state=ACPSGDState, step=step, wire=wire_cost, init=init,
      layout=_layout(rank, min_compression_rate), error_feedback=True, linear_payload=True,
      message=_message(rank, min_compression_rate)))
