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
batch of up to 8 (a transformer's repeated layers share a few shapes), so
the number of matrix products grows an eighth as fast as the model's depth. The factors'
columns of every leaf are orthonormalised in one zero-padded batch
(:meth:`MatrixView.columns`), so neither does the orthonormalisation. On CPU,
where the custom calls of :mod:`jaxcomp._src.native` are built, a bucket's
products, its factors' columns and its residual are one call each
(:func:`_product`, :func:`_factor_columns`, :func:`_residual`): a few kernels a
bucket, not a few per group. The products and the residual then read the leaves and
the residual where they lie and form each corrected row in cache
(:class:`Corrected`): the corrected gradient is never written, ACP-SGD reads it
twice (its product, then its residual) and PowerSGD three times (ResNet-50 at rank
4 on a 2-core Intel Xeon: ACP-SGD 5.2 passes and 0.43x dense's time, PowerSGD 7.2 and
0.64x, against 7.2 and 0.72x, 8.2 and 0.83x with the corrected gradient written
first).

Both methods give a finite, correct mean whenever its rank-one terms fit in
f32, for gradients near 1e38 as near 1e-30. A factor enters a product with the
gradients divided by a power of two (from the shapes, or from the factor
itself where it is identical on every device) that keeps every entry of the
product within the gradients' largest, and stands multiplied by it beside the
other factor in the mean; the orthonormalisation takes rows of any scale
(:func:`_orthonormalize`). A power of two changes exponents only: where the
unscaled products neither overflowed nor underflowed, these are the same values.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
import functools
import itertools
import math
from typing import NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from jaxcomp._src import binade
from jaxcomp._src import checks
from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import selection
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
    groups: ``(count, rows, cols)`` per batch of equal-shaped matrices (at
      most :data:`_BATCH_LEAVES` leaves: a shape of more leaves has several),
      in the order their leaves lie in ``lowrank``; the leaves of one group
      are adjacent.
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
        (count, rows, cols)
        for (rows, cols), members in itertools.groupby(
            chosen, key=lambda i: _matrix_shape(tuple(leaves[i].shape)))
        for count in _batches(len(list(members)))
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

  @property
  def runs(self) -> tuple[int, ...]:
    """The leaves of :attr:`bucket` in runs (:attr:`jaxcomp.protocol.Method.runs`): one
    per group, then the dense leaves."""
    return tuple(g for g, _, _ in self.groups) + (len(self.dense.leaves),)

  def matrices(self, runs: tuple[jax.Array, ...]) -> list[jax.Array]:
    """The corrected gradient's runs (:attr:`runs`) as one ``[count, rows, cols]``
    batch per group."""
    return [run.reshape(shape) for run, shape in zip(runs, self.groups)]

  def p_factors(self, flat: jax.Array) -> list[jax.Array]:
    """A flat ``P`` buffer as one ``[count, rows, r]`` batch per group."""
    return _split(flat, [(g, rows, self.rank) for g, rows, _ in self.groups])

  def q_factors(self, flat: jax.Array) -> list[jax.Array]:
    """A flat ``Q`` buffer as one ``[count, cols, r]`` batch per group."""
    return _split(flat, [(g, cols, self.rank) for g, _, cols in self.groups])

  def headroom(self, factor: str) -> list[float]:
    """Per group, :func:`_headroom` of the ``P`` (``factor="p"``) or ``Q`` factors' column length."""
    return [_headroom(rows if factor == "p" else cols) for _, rows, cols in self.groups]

  def per_group(self, x: jax.Array) -> list[jax.Array]:
    """``x`` (``[leaves, ...]``, a row per compressed leaf in the order of :attr:`lowrank`)
    as one ``[count, ...]`` piece per group."""
    return list(jnp.split(x, list(itertools.accumulate(g for g, _, _ in self.groups[:-1]))))

  def per_entry(self, values: list[float], factor: str) -> jax.Array:
    """One value per group as ``f32[p_size]`` (``factor="p"``) or ``f32[q_size]``, each
    entry its group's: a factor of the flat buffer, multiplied in one kernel (not one
    per group).

    Computed from an iota, one comparison per change of value along the buffer
    (the headrooms follow the groups' sorted shapes, so they change a few
    times), not read from a constant of the buffer's size.
    """
    sizes = [g * (rows if factor == "p" else cols) * self.rank for g, rows, cols in self.groups]
    position = lax.iota(jnp.int32, sum(sizes))
    entry = jnp.full(position.shape, values[-1] if values else 0.0, jnp.float32)
    ends = list(itertools.accumulate(sizes))
    for i in reversed(range(len(values) - 1)):
      if values[i] != values[i + 1]:
        entry = jnp.where(position < ends[i], jnp.float32(values[i]), entry)
    return entry

  def per_leaf(self, values: list[float]) -> np.ndarray:
    """One value per group as ``f32[leaves, 1, 1]``, each leaf its group's: a factor of
    :meth:`columns`."""
    counts = [g for g, _, _ in self.groups]
    return np.repeat(np.asarray(values, np.float32), counts).reshape(-1, 1, 1)

  def lengths(self, factor: str) -> list[int]:
    """Each compressed leaf's ``P`` (``factor="p"``: its rows) or ``Q`` (its columns)
    length, in the order of :attr:`lowrank`."""
    return [rows if factor == "p" else cols for g, rows, cols in self.groups for _ in range(g)]

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
    """The flat ``P`` (``factor="p"``) or ``Q`` buffer of ``[leaves, r, L]`` columns.

    One gather, the inverse of :meth:`columns`: entry ``(row, j)`` of the
    ``k``-th compressed leaf's factor is ``columns[k, j, row]``. Its indices
    are an int32 constant as large as the buffer (small: the factors), read
    once; a transpose per group would be a kernel per group, and indices
    computed from an iota would test every group's bounds at every entry.
    """
    return self._gathered(columns.reshape(-1), factor, columns.shape[-1])

  def untransposed(self, flat: jax.Array, factor: str) -> jax.Array:
    """The flat ``P`` (``factor="p"``) or ``Q`` buffer from every group's factors
    transposed (``[count, r, rows]`` or ``[count, r, cols]``), flat and end to end.

    The layout a product ``F^T M`` gives; one gather as :meth:`uncolumns`, not
    a transpose per group.
    """
    return self._gathered(flat, factor, None)

  def _gathered(self, flat: jax.Array, factor: str, length: Optional[int]) -> jax.Array:
    """The flat factor buffer read from ``flat``, which holds each leaf's factor as ``r``
    columns of ``length`` entries (``None``: the column's own length, no padding),
    leaf after leaf."""
    index, offset = [], 0
    for g, rows, cols in self.groups:
      n = rows if factor == "p" else cols
      stride = length or n
      k, row, j = np.meshgrid(np.arange(g), np.arange(n), np.arange(self.rank), indexing="ij")
      index.append((offset + (k * self.rank + j) * stride + row).reshape(-1))
      offset += g * self.rank * stride
    if not index:
      return jnp.zeros((0,), flat.dtype)
    return flat.at[np.concatenate(index).astype(np.int32)].get(mode="promise_in_bounds")


# The most leaves in one batch: XLA:CPU fuses the concatenation of at most 8
# leaves into error feedback's addition (jax 0.10.2), and the batch's products
# then read it in place (:attr:`MatrixView.runs`). On the transformer's shapes
# (groups of 12 leaves) PowerSGD made 8.9 passes and ACP-SGD's steps 8.0, against
# 10.4 and 9.5 in one batch per shape, for 24 and 13 more kernels, in 0.82x and
# 0.78x the time (the P step; two runs of each).
_BATCH_LEAVES = fusion.FUSED_CONCATENATION


def _batches(count: int) -> list[int]:
  """``count`` leaves of one shape as batches of at most :data:`_BATCH_LEAVES`, as even
  as can be (11 leaves: 6 and 5)."""
  pieces = -(-count // _BATCH_LEAVES)
  return [count // pieces + (i < count % pieces) for i in range(pieces)]


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


def _headroom(n: int) -> float:
  """``2**k`` for the least ``k`` with ``2**k >= sqrt(n)``.

  A row of ``n`` entries times a column of norm at most 1 is at most
  ``sqrt(n)`` times the row's largest entry (Cauchy-Schwarz, for every
  partial sum too): with the column divided by ``2**k``, never more than it.
  """
  return 2.0 ** (((n - 1).bit_length() + 1) // 2)


def _unit(x: jax.Array, axis: int) -> jax.Array:
  """``x`` times a power of two per slice along ``axis`` that brings the slice's largest
  ``|entry|`` into ``[1, 4)``.

  Exact (a power of two changes exponents only; an entry more than
  ``2**126`` below its slice's largest, far below that one's precision,
  flushes to zero), and the slice's products, projections and norms then
  neither overflow nor underflow where the slice's own would (entries near
  1e38, or near 1e-30). An all-zero slice stays zero; an Inf or NaN stays.
  """
  top = jnp.max(jnp.abs(x), axis=axis, keepdims=True, initial=0.0)  # 0.0: no leaf compressed
  return x * binade.unit_factor(top)


def _gram_schmidt(columns: jax.Array) -> jax.Array:
  """The rows of ``columns`` (``[B, r, L]``) orthonormalised, see :func:`_orthonormalize`."""
  rows = []
  for i in range(columns.shape[-2]):
    row = columns[..., i, :]
    for prev in rows:
      row = row - jnp.sum(prev * row, axis=-1, keepdims=True) * prev
    norm = jnp.sqrt(jnp.sum(row * row, axis=-1, keepdims=True))
    rows.append(row / jnp.where(norm == 0, 1.0, norm))
  return jnp.stack(rows, axis=-2)


# Rows whose largest entry lies in this range square, project and normalise
# in f32 without overflow or underflow: sqrt(L) 2**32 and L 2**64 are far from
# 2**128, 2**-64 far from 2**-126.
_PLAIN_RANGE = (2.0**-32, 2.0**32)


def _orthonormalize(columns: jax.Array) -> jax.Array:
  """Modified Gram-Schmidt on each ``[r, L]`` matrix of a ``[B, r, L]`` batch, row by row.

  Row ``i`` (a factor's column ``i``, see :meth:`MatrixView.columns`) loses
  its projections on the rows before it, then is scaled to norm 1. Every
  factor of every leaf goes through one batch: the program holds ``r``
  rounds of reductions, not ``r`` per matrix shape. Zero padding at the end
  of a row changes no projection and no norm, and stays zero.

  Rows of any finite scale give orthonormal rows. A batch whose rows'
  largest entries all lie in :data:`_PLAIN_RANGE` (or are zero), as an
  ordinary gradient's factors do, goes in as it is; any other is first
  brought to unit scale row by row (:func:`_unit`: a row near 1e38 would
  overflow its projections and its squared norm, ``row / Inf`` a zero row, and
  a row near 1e-30 would square to zero and stay unnormalised). The scaling
  is exact, so both routes give the same result up to rounding. Only the
  scaling sits in the branch (``lax.cond``), and one Gram-Schmidt program
  follows it: a branch that held the whole program compiled it twice (with
  25 MiB buckets on ResNet-50, PowerSGD's ``init`` took about 1.2 s longer).
  The branch's result is a buffer of its own, so the scaling is never fused
  into the products and norms: an ordinary batch's bits are the plain
  program's. The choice reads the batch only, so it is the same on every
  device.

  Deterministic (the same program on the same input gives the same bits on
  every device). A row that is exactly zero after the projections stays
  zero instead of dividing by zero; NaN stays NaN (poison survives).
  """
  top = jnp.max(jnp.abs(columns), axis=-1, initial=0.0)  # 0.0: no leaf compressed
  low, high = _PLAIN_RANGE
  plain = jnp.all((top == 0) | ((top >= low) & (top <= high)))
  return _gram_schmidt(lax.cond(plain, lambda c: c, functools.partial(_unit, axis=-1), columns))


def _refill(new: jax.Array, old: jax.Array) -> jax.Array:
  """``new`` (``[B, r, L]`` columns), with each all-zero factor column replaced by ``old``'s.

  A factor column is zero when its leaf's gradient was zero; warm-starting
  from it would keep the column zero for ever (``M 0 = 0``).
  """
  return jnp.where(jnp.all(new == 0, axis=-1, keepdims=True), old, new)


def _products(p_factors, q_factors) -> list[jax.Array]:
  """``P Q^T`` of every group of equal-shaped matrices, ``[count, rows, cols]`` each.

  One batch per group (torch's ``batched_powerSGD_hook``), not one per leaf:
  a few kernels per bucket. Written as ``rank`` elementwise products summed
  (``rank`` is small), not a matrix product: XLA fuses it into its readers
  (the leaves of the mean, the residual's part of the group), where a
  batched matrix product with a contraction of ``rank`` is a kernel of its
  own, slower on CPU (about a fifth more step time on ResNet-50's shapes).
  """
  def product(p, q):
    total = p[:, :, None, 0] * q[:, None, :, 0]
    for j in range(1, p.shape[-1]):
      total = total + p[:, :, None, j] * q[:, None, :, j]
    return total

  return [product(p, q) for p, q in zip(p_factors, q_factors)]


def _transposed_products(view: MatrixView, matrices: list[jax.Array],
                         p_factors: list[jax.Array], scale: list[float]) -> jax.Array:
  """``M^T (P s)`` of every group (``[count, rows, cols]`` and ``[count, rows, r]``
  batches and the groups' scales ``s`` in), as the flat ``Q`` buffer.

  Formed as ``P^T M`` (``[count, r, cols]``) behind an optimisation barrier,
  and the groups' products laid out as ``Q`` by one gather
  (:meth:`MatrixView.untransposed`; ``r cols`` entries a leaf, small). Left to
  lay the product out itself, XLA:CPU gives it the ``[count, cols, r]``
  layout and reads ``M`` transposed, three times slower (18 ms against 6 for
  ResNet-50's matrices at rank 4).
  """
  return view.untransposed(_join(
      [lax.optimization_barrier(jnp.einsum("gmn,gmr->grn", m, p * s))
       for m, p, s in zip(matrices, p_factors, scale)]), "q")


def _native(view: MatrixView) -> bool:
  """The bucket's products and orthonormalisations are the custom calls of
  :mod:`jaxcomp._src.native` (where :func:`jaxcomp._src.selection.native_route` holds)."""
  return bool(view.groups) and selection.native_route()


class Corrected(NamedTuple):
  """The corrected gradient as both methods' steps read it.

  Attributes:
    matrices: the compressed matrices: one flat run per group
      (:attr:`MatrixView.runs`, written by error feedback's addition), or,
      with ``residual``, one leaf per matrix as the gradient holds it.
    residual: ``None``, or the old residual ``f32[bucket.size]``, which the
      custom calls add to each leaf a row at a time where they read it
      (:func:`_prepare_leaves`): the corrected matrices are then never written.
    dense: the dense leaves' corrected gradient, ``f32[dense.size]``.
  """

  matrices: tuple[jax.Array, ...]
  residual: Optional[jax.Array]
  dense: jax.Array


def _corrected(view: MatrixView, corrected, leaves, residual: jax.Array) -> Corrected:
  """What ``step`` was handed as :class:`Corrected`: its runs (the dense leaves' last), or,
  where :func:`_prepare_leaves` took the bucket, the leaves (the carry) and ``residual``;
  the dense leaves' sum with their span of it (zero: the same bits as error feedback's
  addition) is then one small kernel."""
  if leaves is None:
    return Corrected(tuple(corrected[:-1]), None, corrected[-1])
  count = len(view.lowrank.leaves)
  dense = fusion.concat([x.reshape(-1) for x in leaves[count:]])
  return Corrected(tuple(leaves[:count]), residual, dense + residual[view.lowrank.size:])


def _prepare_leaves(rank: int, min_compression_rate: float):
  """Both methods' :attr:`jaxcomp.protocol.Method.prepare_leaves`: where the custom calls
  take the bucket (:func:`_native`), nothing is formed before the step, whose products
  and residual read the leaves and the residual where they lie (the carry; see
  :class:`Corrected`). Else ``None``: error feedback writes each group's run."""
  def prepare_leaves(ctx, leaves, state):
    del state
    view = _view_of(ctx.bucket, rank, min_compression_rate)
    return (None, leaves) if _native(view) else None
  return prepare_leaves


def _product(view: MatrixView, corrected: Corrected, factor: jax.Array,
             scale: list[float], dense: Optional[jax.Array] = None, *, transposed: bool = False,
             unit: bool = False) -> jax.Array:
  """Every compressed matrix times its factor, as one flat factor buffer, then ``dense``.

  ``M_i (F_i s)`` (``F``: the flat ``Q`` buffer), or with ``transposed``
  ``M_i^T (F_i s)`` (``F``: the flat ``P`` buffer), ``s`` the group's
  ``scale`` (a power of two), each column first brought to ``[1, 2)`` by
  :func:`jaxcomp._src.binade.unit_factor` of its largest magnitude where
  ``unit`` is set. ``corrected``: the matrices ``M_i``.

  Where :func:`_native` holds, one custom call for the bucket
  (:func:`jaxcomp._src.native.lowrank_product`, which also writes ``dense``
  after the products), where XLA:CPU makes a scaling and a product per group
  of equal shapes (ResNet-50: 21 groups in one bucket, 27 in five); the two
  routes' sums run in other orders and agree to rounding.
  """
  if _native(view):
    return native.lowrank_product(
        corrected.matrices, factor, view.per_leaf(scale),
        jnp.zeros((0,)) if dense is None else dense, view.groups, view.rank,
        transposed=transposed, unit=unit, residual=corrected.residual)
  runs = corrected.matrices
  if transposed:
    products = _transposed_products(view, view.matrices(runs), view.p_factors(factor), scale)
  else:
    factors = view.q_factors(factor)
    if unit:
      # The scales of every leaf's columns come from one reduction over the columns
      # (of |F|, so that its gather is fused into the reduction).
      top = jnp.max(view.columns(jnp.abs(factor), "q"), axis=-1, initial=0.0)  # 0.0: no leaf
      factors = [f * u for f, u in zip(factors, view.per_group(binade.unit_factor(top)[:, None, :]))]
    products = _join([jnp.einsum("gmn,gnr->gmr", m, f * s)
                      for m, f, s in zip(view.matrices(runs), factors, scale)])
  return products if dense is None else jnp.concatenate([products, dense])


def _factor_columns(view: MatrixView, flat: jax.Array, factor: str, *,
                    old: Optional[jax.Array] = None, scales: Optional[list[float]] = None,
                    orthonormalize: bool = True) -> jax.Array:
  """The flat ``P`` (``factor="p"``) or ``Q`` buffer worked on column by column, in order:
  with ``scales`` (one per group), each column times its group's scale where all of
  that product is finite; with ``old``, a column that is all zero replaced by ``old``'s
  (:func:`_refill`); with ``orthonormalize``, each leaf's columns orthonormalised
  (:func:`_orthonormalize`).

  Where :func:`_native` holds, one custom call (:func:`jaxcomp._src.native.factor_columns`,
  in float64, so no column is rescaled), where XLA makes about six kernels per column
  of the factors and a gather on either side (every leaf in one batch,
  :meth:`MatrixView.columns`).
  """
  if _native(view):
    return native.factor_columns(flat, view.lengths(factor), view.rank, old=old,
                                 scales=None if scales is None else view.per_leaf(scales),
                                 orthonormalize=orthonormalize)
  columns = view.columns(flat, factor)
  if scales is not None:
    full = columns * view.per_leaf(scales)
    columns = jnp.where(jnp.all(jnp.isfinite(full), axis=-1, keepdims=True), full, columns)
  if old is not None:
    columns = _refill(columns, view.columns(old, factor))
  return view.uncolumns(_orthonormalize(columns) if orthonormalize else columns, factor)


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


def _runs(rank: int, min_compression_rate: float):
  """Both methods' runs of a bucket (:attr:`MatrixView.runs`): each group's matrices are
  fused and corrected in one kernel, and read by the group's products in place."""
  return lambda bucket: _view_of(bucket, rank, min_compression_rate).runs


def _view_of(bucket: fusion.Bucket, rank: int, min_compression_rate: float) -> MatrixView:
  """The :class:`MatrixView` of a bucket laid out by :func:`_layout` (positions: bucket order)."""
  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in zip(bucket.shapes, bucket.dtypes)]
  return MatrixView.of(shapes, rank, min_compression_rate)


def _mean_of(view: MatrixView, p: jax.Array, q: jax.Array, dense_mean: jax.Array) -> list:
  """The mean per bucket leaf from the mean's flat ``P`` and ``Q`` buffers and the dense
  leaves' mean: slices of the groups' products, then the dense leaves' slices."""
  products = _products(view.p_factors(p), view.q_factors(q))
  return [product[i] for product in products for i in range(product.shape[0])] + (
      view.dense.split(dense_mean))


def _message(rank: int, min_compression_rate: float) -> protocol.Message:
  """Both methods' mean as its factors: ``f32[p_size + q_size + dense.size]``, ``[P, Q, dense]``.

  ``P Q^T`` is the mean; one of the two is sent scaled down by a power of
  two and the other carries the inverse scale (see the module's note).

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


def _residual(view: MatrixView, corrected: Corrected, p: jax.Array,
              q: jax.Array) -> Union[fusion.Pieces, fusion.Rewrite]:
  """``M - P Q^T`` of each group (``corrected``: the matrices as ``step`` received them;
  ``P``, ``Q``: the flat factors as sent), one piece per group written in place; the
  dense leaves' residual stays (zero). Where :func:`_native` holds, one custom call
  writes every group over the old residual in place
  (:func:`jaxcomp._src.native.lowrank_residual`), from the leaves and that old
  residual where :class:`Corrected` holds them.

  Both methods hand it over as a function (:attr:`jaxcomp.protocol.Output.residual`),
  formed inside the branch that keeps the step on CPU: it reads the corrected
  matrices as they were written once for the products (XLA's route), or the leaves
  and the old residual as the products read them (the custom calls'). Formed before the
  branch, XLA:CPU fuses the error feedback's addition into it again, and each
  group's concatenation of leaves, read by both, is then written out apart
  (PowerSGD on ResNet-50 at rank 4: 9.5 passes and 357 kernels formed in the
  branch, 13.4 and 380 before it). It takes the runs flat, as they were made: a group of one leaf
  read as ``[1, rows, cols]`` here and as ``[rows, cols]`` by its products had
  its addition computed twice (8.9 passes and 348 kernels, against 9.5 and 357).
  Each group's piece keeps its ``[count, rows, cols]`` shape, so that it is
  written in rows of the buffer (:func:`jaxcomp._src.fusion.overwrite`): PowerSGD's
  step on one device took 142 ms flat against 113 in rows of 8 (ResNet-50), 691
  against 408 in rows of 64 (the transformer).
  """
  if _native(view):
    return fusion.Rewrite(lambda old: native.lowrank_residual(
        old, corrected.matrices, p, q, view.groups, view.rank,
        from_leaves=corrected.residual is not None))
  products = _products(view.p_factors(p), view.q_factors(q))
  offsets = itertools.accumulate((f.size for f in products[:-1]), initial=0)
  return fusion.Pieces(tuple(offsets), tuple(
      run.reshape(f.shape) - f for run, f in zip(corrected.matrices, products)))


# -------------------------------------------------------------------- PowerSGD


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd`.

  Attributes:
    count: steps taken (int32, saturating).
    residual: ``f32[n]``, the gradient fused in the method's order (the
      compressed leaves by matrix shape, then the dense ones; a tuple of one
      per bucket with ``bucket_cap_mb``), this device's error feedback (zero
      on the leaves sent dense).
    q: f32 flat buffer of every compressed leaf's ``Q`` factor (the reduced
      one of the last step, identical on every device), the warm start. A
      column too large for f32 (it reaches ``sqrt(rows)`` times the
      gradient's largest entry) is kept divided by :func:`_headroom` of
      ``rows``: the warm start reads the columns' directions only. With
      two buckets or more (``bucket_cap_mb``), a tuple of such buffers, one per
      bucket.
    rng_key: raw ``uint32`` key, identical on every device (never folded with
      the device index); draws a fresh ``Q`` each step when ``warm_start`` is
      off.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]
  q: Union[jax.Array, tuple[jax.Array, ...]]
  rng_key: jax.Array


def powersgd(
    rank: int,
    axis_name: checks.AxisName,
    min_compression_rate: float = 2.0,
    *,
    warm_start: bool = True,
    seed: int = 0,
    bucket_cap_mb: Optional[float] = None,
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
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket's
      matrices are factored on their own, and ``q`` in the state holds one
      buffer per bucket (with two buckets or more).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` returns the
    low-rank approximation of the mean gradient (dense mean for the dense
    leaves), identical on every device, in the dtype of ``updates``. State:
    :class:`PowerSGDState`.

  Wire: two fused mean all-reduces per step, of
  ``sum r * rows`` (plus the dense leaves) and ``sum r * cols`` f32: ring
  all-reduces, ``2 (P - 1) / P * 4 (r (rows + cols) + n_dense)`` bytes per
  device; on a torus each is a reduce-scatter, all-reduce and all-gather.
  With buckets, two all-reduces per bucket, of its own leaves.

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
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)

  def init(params, bucket):
    _, q = _init_factors(_view_of(bucket, rank, min_compression_rate), seed)
    return {"q": q, "rng_key": checks.raw_key(seed)}  # the key stays put with a warm start

  def step(ctx, corrected, state):
    view = _view_of(ctx.bucket, rank, min_compression_rate)
    corrected = _corrected(view, corrected, ctx.carry, state.residual)
    q_start = state.q
    if not warm_start:
      q_start = jax.random.normal(ctx.key, (view.q_size,), jnp.float32)
    # The warm start carries the last mean's magnitude (its product with M would be
    # |M|^2), and P's orthonormalisation reads only the directions of its columns:
    # each column of Q is brought to [1, 4) (norm < 4 h, h >= sqrt(cols)) and divided
    # by 4 h^2, so no entry of M_i Q exceeds the largest of M_i.
    reduced = ctx.mean(_product(view, corrected, q_start,
                                [0.25 / h**2 for h in view.headroom("q")], corrected.dense,
                                unit=True))
    p_hat = _factor_columns(view, reduced[:view.p_size], "p")
    # A column of M_i^T P^ reaches sqrt(rows) times the largest entry of M_i: it is
    # taken with P^ / h and sent so; P^ h stands beside it in every product.
    p_room = view.headroom("p")
    local_q = _product(view, corrected, p_hat, [1 / h for h in p_room], transposed=True)
    q_mean = ctx.mean(local_q)
    p_flat = p_hat * view.per_entry(p_room, "p")
    # The state holds the reduced Q itself where its column fits in f32, and the
    # column as sent where it does not (the warm start reads its direction only).
    new_q = _factor_columns(view, q_mean, "q", old=q_start, scales=p_room,
                            orthonormalize=False)
    dense_mean = reduced[view.p_size:]
    return protocol.Output(
        mean=_mean_of(view, p_flat, q_mean, dense_mean),
        residual=lambda: _residual(view, corrected, p_flat, local_q),
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
                  warm_start=warm_start, seed=seed, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=PowerSGDState, step=step, wire=wire_cost, init=init,
      layout=_layout(rank, min_compression_rate), runs=_runs(rank, min_compression_rate),
      error_feedback=True, prepare_leaves=_prepare_leaves(rank, min_compression_rate),
      seed=None if warm_start else seed, payload_carries_nonfinite=True,
      message=_message(rank, min_compression_rate), bucket_cap_mb=bucket_cap_mb,
      bucket_fields=("q",)))


# --------------------------------------------------------------------- ACP-SGD


class _Renewal(NamedTuple):
  """What an ACP-SGD step leaves for :func:`_renew`: its bucket's reduced factor, which
  factor it is (``even``: ``P``), and the bucket's old factors.

  ``reduced``: on XLA's route the reduced factor refilled, as ``[leaves, r, L]``
  columns (:meth:`MatrixView.columns`); where :func:`_native` holds, the step's
  flat ``(P, Q)`` of the mean, refilled by the custom call itself."""

  view: MatrixView
  reduced: Union[jax.Array, tuple[jax.Array, jax.Array]]
  even: Union[bool, jax.Array]
  p: jax.Array
  q: jax.Array


def _renew(renewals: list[_Renewal]) -> list[dict[str, jax.Array]]:
  """Every bucket's new ``P`` and ``Q`` (ACP-SGD's :attr:`jaxcomp.protocol.Method.finish`):
  the buckets' reduced factors orthonormalised after the last exchange, in a few batches.

  The buckets' columns (each bucket's zero-padded to its own longest) are
  batched longest first, a bucket joining the batch before while the batch,
  padded to its longest column, stays within 1.25x the entries of its buckets'
  own columns (padding changes no projection and no norm, but each of the
  ``r`` rounds of reductions reads it): with 25 MiB buckets, ResNet-50's five
  buckets make two batches, a transformer's fourteen two in the P step (its
  embedding's long columns alone) and one in the Q step, where one batch of
  all would read 1.8x and 8.5x the entries in the P step.
  No exchange waits for it (the factor is the next step's). Where the custom
  calls run (:func:`_native`), one call per bucket and factor, in float64.
  """
  renewed: list[dict[str, jax.Array]] = [{} for _ in renewals]
  apart = [i for i, r in enumerate(renewals) if isinstance(r.reduced, tuple)]
  for i in apart:
    r = renewals[i]
    p_mean, q_mean = r.reduced
    # A form picked on the host renews its own factor only.
    p = r.p if r.even is False else _factor_columns(r.view, p_mean, "p", old=r.p)
    q = r.q if r.even is True else _factor_columns(r.view, q_mean, "q", old=r.q)
    renewed[i] = {"p": jnp.where(r.even, p, r.p), "q": jnp.where(r.even, r.q, q)}
  columns = [i for i in range(len(renewals)) if i not in apart]
  lengths = {i: renewals[i].reduced.shape[-1] for i in columns}
  counts = {i: renewals[i].reduced.shape[0] for i in columns}
  batches: list[list[int]] = []
  for i in sorted(columns, key=lambda i: -lengths[i]):  # stable
    if batches:
      joined = batches[-1] + [i]
      padded = lengths[joined[0]] * sum(counts[j] for j in joined)
      if 4 * padded <= 5 * sum(lengths[j] * counts[j] for j in joined):
        batches[-1] = joined
        continue
    batches.append([i])
  for batch in batches:
    length = lengths[batch[0]]
    padded = [jnp.pad(renewals[i].reduced, ((0, 0), (0, 0), (0, length - lengths[i])))
              for i in batch]
    ortho = _orthonormalize(jnp.concatenate(padded))
    parts = jnp.split(ortho, list(itertools.accumulate(counts[i] for i in batch[:-1])))
    for i, part in zip(batch, parts):
      r = renewals[i]
      renewed[i] = {"p": jnp.where(r.even, r.view.uncolumns(part, "p"), r.p),
                    "q": jnp.where(r.even, r.q, r.view.uncolumns(part, "q"))}
  return renewed


class ACPSGDState(NamedTuple):
  """State of :func:`acpsgd`.

  Attributes:
    count: steps taken (int32, saturating); its parity picks the factor.
    residual: ``f32[n]``, the gradient fused in the method's order (the
      compressed leaves by matrix shape, then the dense ones; a tuple of one
      per bucket with ``bucket_cap_mb``), this device's error feedback (zero
      on the leaves sent dense).
    p: f32 flat buffer of the orthonormal ``P`` factors of the last even
      step, identical on every device (used by the next odd step).
    q: f32 flat buffer of the orthonormal ``Q`` factors of the last odd step
      (or the initial ones), identical on every device.

  With two buckets or more (``bucket_cap_mb``), ``p`` and ``q`` are tuples of
  such buffers, one per bucket.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]
  p: Union[jax.Array, tuple[jax.Array, ...]]
  q: Union[jax.Array, tuple[jax.Array, ...]]


def acpsgd(
    rank: int,
    axis_name: checks.AxisName,
    min_compression_rate: float = 2.0,
    *,
    seed: int = 0,
    bucket_cap_mb: Optional[float] = None,
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
  point). The step's form is the parity of ``count``: 0 the P step, 1 the
  Q step. The step builders (:func:`jaxcomp.training.make_step`,
  :func:`jaxcomp.training.make_fsdp_step`) compile one program per form and
  pick it on the host, so that no exchange sits inside a conditional (where
  it could not overlap the backward pass); ``update`` alone holds both in
  one program (a ``lax.switch`` on the parity, the same on every device). A
  branch holds the product and the all-reduce; the orthonormalisation
  waits for the last bucket's exchange and takes every bucket's factor in
  a few batches (:func:`_renew`: with 25 MiB buckets on ResNet-50, 396
  kernels for the P step against 459 with one batch per bucket). Error feedback as in
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
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket's
      matrices are factored on their own, and ``p``, ``q`` in the state hold one
      buffer per bucket (with two buckets or more).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` returns the low-rank
    mean gradient, identical on every device, in the dtype of ``updates``.
    State: :class:`ACPSGDState`.

  Wire: one fused mean all-reduce per step: on even steps of
  ``sum r * rows + n_dense`` f32, on odd steps of ``sum r * cols + n_dense``
  (a ring all-reduce, ``2 (P - 1) / P * 4 s`` bytes; on a torus a
  reduce-scatter, all-reduce and all-gather). The wire formula weights each
  branch 1/2. With buckets, one all-reduce per bucket, of its own leaves.

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
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)

  def init(params, bucket):
    p, q = _init_factors(_view_of(bucket, rank, min_compression_rate), seed)
    return {"p": p, "q": q}

  def step(ctx, corrected, state):
    view = _view_of(ctx.bucket, rank, min_compression_rate)
    corrected = _corrected(view, corrected, ctx.carry, state.residual)
    # The reduced factor's columns, zero-padded to one length: its own factor's
    # longest column where the form is picked on the host, else the longest of P
    # and Q, so that both branches of the switch return one shape.
    length = view.length(("p" if ctx.form == 0 else "q") if isinstance(ctx.form, int) else "pq")

    # The branches hold the product and the exchange only, and return
    # factors: (P, Q) of the mean and of this device's contribution, and the
    # reduced factor and its old value as columns. The n-sized products are
    # made once, after the switch, and the orthonormalisation after every
    # bucket's exchange (a branch's n-sized outputs would be fresh buffers,
    # copied from, and a branch's own program compiles slowly).
    # A column of M_i Q^ (of M_i^T P^) reaches sqrt(cols) (sqrt(rows)) times the
    # largest entry of M_i: it is taken with the orthonormal factor divided by h and
    # sent so, and the factor times h stands beside it in every product. The
    # orthonormalisation reads the reduced factor's directions only.
    # The custom calls orthonormalise the flat factors themselves; XLA's route takes
    # them as columns, made in the branch.
    columns = not _native(view)

    def p_step(matrices):
      q_room = view.headroom("q")
      sent = _product(view, matrices, state.q, [1 / h for h in q_room], matrices.dense)
      reduced = ctx.mean(sent)
      p_mean = reduced[:view.p_size]
      q_beside = state.q * view.per_entry(q_room, "q")
      return (p_mean, q_beside, sent[:view.p_size], q_beside, reduced[view.p_size:]) + (
          (view.columns(p_mean, "p", length), view.columns(state.p, "p", length))
          if columns else ())

    def q_step(matrices):
      p_room = view.headroom("p")
      sent = _product(view, matrices, state.p, [1 / h for h in p_room], matrices.dense,
                      transposed=True)
      reduced = ctx.mean(sent)
      q_mean = reduced[:view.q_size]
      p_beside = state.p * view.per_entry(p_room, "p")
      return (p_beside, q_mean, p_beside, sent[:view.q_size], reduced[view.q_size:]) + (
          (view.columns(q_mean, "q", length), view.columns(state.q, "q", length))
          if columns else ())

    p_mean, q_mean, p_sent, q_sent, dense_mean, *fresh_old = ctx.switch(
        (p_step, q_step), corrected)
    reduced = _refill(*fresh_old) if columns else (p_mean, q_mean)
    return protocol.Output(
        mean=_mean_of(view, p_mean, q_mean, dense_mean),
        residual=lambda: _residual(view, corrected, p_sent, q_sent),
        witness=(p_mean, q_mean, dense_mean),
        message=jnp.concatenate([p_mean, q_mean, dense_mean]),
        finish=_Renewal(view, reduced, ctx.form == 0, state.p, state.q))

  def wire_cost(bucket, sizes, steps):
    del steps
    view = _view_of(bucket, rank, min_compression_rate)
    return (wire.in_branch(wire.mean(view.p_size + view.dense.size, sizes), 0, Fraction(1, 2))
            + wire.in_branch(wire.mean(view.q_size + view.dense.size, sizes), 1, Fraction(1, 2)))

  return protocol.compressor(protocol.Method(
      name="acpsgd",
      config=dict(rank=rank, axis_name=axis_name, min_compression_rate=min_compression_rate,
                  seed=seed, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=ACPSGDState, step=step, wire=wire_cost, init=init,
      layout=_layout(rank, min_compression_rate), runs=_runs(rank, min_compression_rate),
      error_feedback=True, prepare_leaves=_prepare_leaves(rank, min_compression_rate),
      payload_carries_nonfinite=True,
      message=_message(rank, min_compression_rate), bucket_cap_mb=bucket_cap_mb,
      bucket_fields=("p", "q"), form=lambda count: count % 2, finish=_renew))
