"""Low-rank compressors: PowerSGD and ACP-SGD, and the matrix view they share.

Each gradient leaf of rank >= 2 is viewed as a matrix ``M`` of shape
``(prod(shape[:-1]), shape[-1])`` (an HWIO conv kernel as ``(H*W*I, O)``, a
dense kernel as it is) and sent as rank-``r`` factors ``P`` (rows x r) and
``Q`` (cols x r), ``M ~ P Q^T``. A leaf where low rank would not pay (rank 1,
or ``(rows + cols) * r * min_compression_rate > rows * cols``) is sent dense.
Every factor of every compressed leaf is fused into one flat buffer and the
dense leaves ride in the same buffer as the first factor, so a step runs one
fused :func:`jaxcomp.collectives.mean` per factor (the 2D-torus all-reduce when
``axis_name`` is a pair).

Leaves of the same matrix shape are laid side by side and handled as one
batch (the twelve layers of a transformer share four shapes), so the number
of matrix products does not grow with the depth of the model.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import itertools
import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp import base
from jaxcomp import collectives
from jaxcomp import error_feedback
from jaxcomp import fusion


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


def _orthonormalize(factor: jax.Array) -> jax.Array:
  """Modified Gram-Schmidt on the columns of each ``[n, r]`` matrix of a batch.

  Deterministic (the same program on the same input gives the same bits on
  every device). A column that is exactly zero after the projections stays
  zero instead of dividing by zero; NaN stays NaN (poison survives).
  """
  columns = []
  for i in range(factor.shape[-1]):
    col = factor[..., i]
    for prev in columns:
      col = col - jnp.sum(prev * col, axis=-1, keepdims=True) * prev
    norm = jnp.sqrt(jnp.sum(col * col, axis=-1, keepdims=True))
    columns.append(col / jnp.where(norm == 0, 1.0, norm))
  return jnp.stack(columns, axis=-1)


def _refill(new: jax.Array, old: jax.Array) -> jax.Array:
  """``new``, with each all-zero column replaced by ``old``'s.

  A factor column is zero when its leaf's gradient was zero; warm-starting
  from it would keep the column zero for ever (``M 0 = 0``).
  """
  return jnp.where(jnp.all(new == 0, axis=-2, keepdims=True), old, new)


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
  return (_join([_orthonormalize(x) for x in view.p_factors(p)]),
          _join([_orthonormalize(x) for x in view.q_factors(q)]))


def _mean(flat: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return flat if flat.shape[0] == 0 else collectives.mean(flat, axes)


def _mean_bytes(n: int, sizes: tuple[int, ...]) -> base.WireCost:
  return () if n == 0 else collectives.mean_bytes(n, sizes)


def _check_rank(rank: int) -> int:
  if isinstance(rank, bool) or not isinstance(rank, int):
    raise TypeError(f"`rank` must be an int >= 1, got {rank!r}")
  if rank < 1:
    raise ValueError(f"`rank` must be >= 1, got {rank}")
  return rank


def _check_min_compression_rate(rate: float) -> float:
  if isinstance(rate, bool) or not isinstance(rate, (int, float)):
    raise TypeError(f"`min_compression_rate` must be a number >= 1, got {rate!r}")
  if not rate >= 1.0:  # also rejects NaN
    raise ValueError(f"`min_compression_rate` must be >= 1, got {rate}")
  return float(rate)


def _rebuild(view: MatrixView, updates, approx, dense_mean: jax.Array):
  """``updates`` with the low-rank leaves set to ``approx`` (:func:`_products`) and the others to ``dense_mean``.

  The step's finiteness is read from ``approx`` and the flat ``dense_mean``,
  not from the dense leaves: one reduction per leaf of a fused buffer makes
  XLA's compile time grow with the square of the number of leaves (minutes
  on ResNet-50), one per buffer does not.
  """
  lowrank = view.lowrank
  out = fusion.scatter_leaves(updates, {
      i: a.reshape(shape).astype(dtype)
      for i, a, shape, dtype in zip(lowrank.leaves, approx, lowrank.shapes, lowrank.dtypes)})
  return view.dense.unflatten(dense_mean, like=out)


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
    axis_name: base.AxisName,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    seed: int = 0,
) -> base.Compressor:
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
    A :class:`jaxcomp.base.Compressor` whose ``update`` returns the
    low-rank approximation of the mean gradient (dense mean for the dense
    leaves), identical on every device, in the dtype of ``updates``. State:
    :class:`PowerSGDState`.

  Wire: two fused :func:`jaxcomp.collectives.mean` calls per step, of
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
  axes = base.check_axis_name(axis_name)
  min_compression_rate = _check_min_compression_rate(min_compression_rate)
  if not isinstance(warm_start, bool):
    raise TypeError(f"`warm_start` must be a bool, got {warm_start!r}")
  seed = base.check_seed(seed)

  def init_fn(params: optax.Params) -> PowerSGDState:
    view = MatrixView.of(params, rank, min_compression_rate)
    _, q = _init_factors(view, seed)
    return PowerSGDState(
        count=base.zero_count(),
        residual=error_feedback.init(params),
        q=q,
        rng_key=base.raw_key(seed),
    )

  def update_fn(updates, state: PowerSGDState, params=None):
    del params
    error_feedback.check_matches(updates, state.residual)
    view = MatrixView.of(updates, rank, min_compression_rate)
    finite = base.all_finite(updates)
    key, q_start = jax.random.wrap_key_data(state.rng_key), state.q
    if not warm_start:
      key, draw = jax.random.split(key)
      q_start = jax.random.normal(draw, (view.q_size,), jnp.float32)

    corrected = error_feedback.compensate(view.lowrank, updates, state.residual)
    matrices = view.matrices(corrected)
    local_p = [jnp.einsum("gmn,gnr->gmr", m, q)
               for m, q in zip(matrices, view.q_factors(q_start))]
    payload = jnp.concatenate([_join(local_p), view.dense.flatten(updates)])
    reduced = _mean(base.poison(payload, finite), axes)
    p_hat = [_orthonormalize(p) for p in view.p_factors(reduced[:view.p_size])]
    local_q = [jnp.einsum("gmn,gmr->gnr", m, p) for m, p in zip(matrices, p_hat)]
    q_mean = _mean(base.poison(_join(local_q), finite), axes)

    approx = _products(p_hat, view.q_factors(q_mean))
    sent = _products(p_hat, local_q)
    dense_mean = reduced[view.p_size:]
    result = _rebuild(view, updates, approx, dense_mean)
    new_state = PowerSGDState(
        count=base.safe_increment(state.count),
        residual=error_feedback.absorb_leaves(view.lowrank, corrected, sent, state.residual),
        q=_join([_refill(new, old) for new, old in zip(
            view.q_factors(q_mean), view.q_factors(q_start))]),
        rng_key=jax.random.key_data(key),
    )
    return result, base.keep_if_finite((approx, dense_mean), new_state, state)

  def wire_bytes(params, num_devices):
    sizes = base.normalize_axis_sizes(axes, num_devices)
    view = MatrixView.of(params, rank, min_compression_rate)
    return (_mean_bytes(view.p_size + view.dense.size, sizes)
            + _mean_bytes(view.q_size, sizes))

  return base.Compressor(init_fn, update_fn, wire_bytes)


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
    axis_name: base.AxisName,
    min_compression_rate: float = 2.0,
    seed: int = 0,
) -> base.Compressor:
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
  point). Both branches live in one compiled program (``lax.cond`` on the
  parity of ``count``, the same on every device). Error feedback as in
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
    A :class:`jaxcomp.base.Compressor` whose ``update`` returns the low-rank
    mean gradient, identical on every device, in the dtype of ``updates``.
    State: :class:`ACPSGDState`.

  Wire: one fused :func:`jaxcomp.collectives.mean` per step: on even steps of
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
  axes = base.check_axis_name(axis_name)
  min_compression_rate = _check_min_compression_rate(min_compression_rate)
  seed = base.check_seed(seed)

  def init_fn(params: optax.Params) -> ACPSGDState:
    view = MatrixView.of(params, rank, min_compression_rate)
    p, q = _init_factors(view, seed)
    return ACPSGDState(
        count=base.zero_count(), residual=error_feedback.init(params), p=p, q=q)

  def update_fn(updates, state: ACPSGDState, params=None):
    del params
    error_feedback.check_matches(updates, state.residual)
    view = MatrixView.of(updates, rank, min_compression_rate)
    finite = base.all_finite(updates)
    corrected = error_feedback.compensate(view.lowrank, updates, state.residual)
    dense = view.dense.flatten(updates)
    p_old, q_old = view.p_factors(state.p), view.q_factors(state.q)

    # The branches return factors only, (P, Q) of the mean and of this
    # device's contribution: the n-sized products are made once, after the
    # cond, straight into the result and the residual (a cond's n-sized
    # outputs would be fresh buffers, copied from).
    def p_step(matrices):
      local = [jnp.einsum("gmn,gnr->gmr", m, q) for m, q in zip(matrices, q_old)]
      reduced = _mean(base.poison(jnp.concatenate([_join(local), dense]), finite), axes)
      p_mean = view.p_factors(reduced[:view.p_size])
      new_p = _join([_orthonormalize(_refill(new, old)) for new, old in zip(p_mean, p_old)])
      return (reduced[:view.p_size], state.q, _join(local), state.q,
              reduced[view.p_size:], new_p, state.q)

    def q_step(matrices):
      local = [jnp.einsum("gmn,gmr->gnr", m, p) for m, p in zip(matrices, p_old)]
      reduced = _mean(base.poison(jnp.concatenate([_join(local), dense]), finite), axes)
      q_mean = view.q_factors(reduced[:view.q_size])
      new_q = _join([_orthonormalize(_refill(new, old)) for new, old in zip(q_mean, q_old)])
      return (state.p, reduced[:view.q_size], state.p, _join(local),
              reduced[view.q_size:], state.p, new_q)

    p_mean, q_mean, p_sent, q_sent, dense_mean, new_p, new_q = lax.cond(
        state.count % 2 == 0, p_step, q_step, view.matrices(corrected))
    approx = _products(view.p_factors(p_mean), view.q_factors(q_mean))
    sent = _products(view.p_factors(p_sent), view.q_factors(q_sent))
    result = _rebuild(view, updates, approx, dense_mean)
    new_state = ACPSGDState(
        count=base.safe_increment(state.count),
        residual=error_feedback.absorb_leaves(view.lowrank, corrected, sent, state.residual),
        p=new_p,
        q=new_q,
    )
    return result, base.keep_if_finite((approx, dense_mean), new_state, state)

  def wire_bytes(params, num_devices):
    sizes = base.normalize_axis_sizes(axes, num_devices)
    view = MatrixView.of(params, rank, min_compression_rate)
    half = fractions.Fraction(1, 2)
    return (
        collectives.every_other_step(_mean_bytes(view.p_size + view.dense.size, sizes), half)
        + collectives.every_other_step(_mean_bytes(view.q_size + view.dense.size, sizes), half))

  return base.Compressor(init_fn, update_fn, wire_bytes)
