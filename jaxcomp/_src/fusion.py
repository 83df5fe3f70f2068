"""Tensor fusion: a gradient pytree as one flat f32 bucket, and back.

Only real floating leaves are fused: ``float0`` leaves (the gradients of
integer parameters under ``jax.grad(..., allow_int=True)``) and zero-size
leaves carry nothing and pass through untouched; complex and integer
gradients are refused by :func:`check_leaves` with the leaf's path.

Compressors select and communicate once per bucket, not once per leaf: one
top-k over the whole model (as the papers do), one all-reduce for every leaf
sent dense. A :class:`Bucket` is static (shapes and dtypes only), so it is
built at trace time and costs nothing at run time beyond the concatenation.

Example::

  bucket = fusion.Bucket.of(grads)                      # all leaves
  flat = bucket.flatten(grads)                          # f32[bucket.size]
  grads_again = bucket.unflatten(flat, like=grads)      # leaf dtypes restored
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Some leaves of a pytree (by position), laid end to end in f32.

  Attributes:
    leaves: positions, in ``jax.tree.leaves`` order, of the leaves it holds.
    shapes: their shapes.
    dtypes: their dtypes (restored by :meth:`unflatten`).
  """

  leaves: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[jnp.dtype, ...]

  @classmethod
  def of(
      cls, tree: chex.ArrayTree,
      where: Optional[Callable[[tuple[int, ...]], bool]] = None,
  ) -> "Bucket":
    """The bucket of the fusable leaves of ``tree`` whose shape satisfies ``where`` (all by default).

    Fusable: a real floating dtype (not ``float0``) and at least one element.
    """
    leaves = jax.tree.leaves(tree)
    chosen = [i for i, x in enumerate(leaves)
              if _fusable(x) and (where is None or where(tuple(x.shape)))]
    return cls(
        leaves=tuple(chosen),
        shapes=tuple(tuple(leaves[i].shape) for i in chosen),
        dtypes=tuple(jnp.dtype(leaves[i].dtype) for i in chosen),
    )

  def __add__(self, other: "Bucket") -> "Bucket":
    """The leaves of ``self``, then those of ``other``, in one bucket."""
    return Bucket(self.leaves + other.leaves, self.shapes + other.shapes,
                  self.dtypes + other.dtypes)

  def part(self, start: int, stop: int) -> "Bucket":
    """The bucket of its leaves ``start`` to ``stop - 1`` (a contiguous run of the flat buffer)."""
    return Bucket(self.leaves[start:stop], self.shapes[start:stop], self.dtypes[start:stop])

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def size(self) -> int:
    """Number of elements in the flat bucket."""
    return sum(self.sizes)

  @property
  def offsets(self) -> tuple[int, ...]:
    out, total = [], 0
    for n in self.sizes:
      out.append(total)
      total += n
    return tuple(out)

  def flatten(self, tree: chex.ArrayTree, length: Optional[int] = None) -> jax.Array:
    """``f32[size]``: the bucket's leaves of ``tree``, raveled and concatenated;
    ``f32[length]`` with ``length`` (at least ``size``): zeros after them, written by
    the same concatenation."""
    leaves = jax.tree.leaves(tree)
    parts = [leaves[i].reshape(-1).astype(jnp.float32) for i in self.leaves]
    if length is not None and length > self.size:
      parts.append(jnp.zeros((length - self.size,), jnp.float32))
    return concat(parts)

  def split(self, flat: jax.Array) -> list[jax.Array]:
    """The leaves of a flat bucket, in their shapes, still f32."""
    return [
        flat[o:o + n].reshape(s)
        for o, n, s in zip(self.offsets, self.sizes, self.shapes)
    ]

  def unflatten(self, flat, like: chex.ArrayTree) -> chex.ArrayTree:
    """``like`` with the bucket's leaves replaced by ``flat``'s, in their dtypes.

    ``flat`` is ``f32[size]``, or one array per leaf (any shape of the
    leaf's size: a method may build each leaf's values apart).
    """
    parts = flat if isinstance(flat, (list, tuple)) else self.split(flat)
    return scatter_leaves(like, {i: x.reshape(s).astype(d) for i, x, s, d in zip(
        self.leaves, parts, self.shapes, self.dtypes)})


# torch DDP's first bucket: small, so that the first exchange starts early.
FIRST_BUCKET_MB = 1.0
_MIB = 2**20


def plan(bucket: Bucket, cap_mb: Optional[float],
         order: Optional[Sequence[int]] = None) -> tuple[Bucket, ...]:
  """``bucket``'s leaves cut into buckets of about ``cap_mb`` MiB, in the order a backward pass makes them.

  torch DDP's rule (``bucket_cap_mb``): leaves are taken in reverse tree
  order (the last layers' gradients exist first), each added to the open
  bucket, which closes once it holds ``cap_mb`` MiB of gradient (the
  leaves' own dtypes) or more; the first closes at
  ``min(FIRST_BUCKET_MB, cap_mb)``. A leaf larger than the cap closes the
  bucket it joins. Within a bucket the leaves keep ``bucket``'s order (the
  method's layout). ``cap_mb=None`` or no leaf: ``(bucket,)``, one bucket.

  ``order``: the tree positions of the leaves in the order their gradients
  are made (:func:`jaxcomp.training.backward_order`), first made first, in
  place of the reverse tree order: where the tree's order is not the layers'
  (keys sorted by name), so that the first bucket holds the first gradients
  made. It must hold every position of ``bucket``'s leaves.

  Returns:
    The buckets in exchange order: the first holds the first gradients made.
  """
  if cap_mb is None or not bucket.leaves:
    return (bucket,)
  if order is None:
    by_position = sorted(range(len(bucket.leaves)), key=lambda j: bucket.leaves[j], reverse=True)
  else:
    rank = {leaf: i for i, leaf in enumerate(order)}
    missing = sorted(set(bucket.leaves) - set(rank))
    if missing:
      raise ValueError(f"the bucket order names no place for the leaves at tree positions"
                       f" {missing}: it must hold every leaf's position once")
    by_position = sorted(range(len(bucket.leaves)), key=lambda j: rank[bucket.leaves[j]])
  groups, current, filled = [], [], 0
  limit = min(FIRST_BUCKET_MB, cap_mb) * _MIB
  for j in by_position:
    current.append(j)
    filled += bucket.sizes[j] * jnp.dtype(bucket.dtypes[j]).itemsize
    if filled >= limit:
      groups.append(current)
      current, filled, limit = [], 0, cap_mb * _MIB
  if current:
    groups.append(current)
  return tuple(
      Bucket(tuple(bucket.leaves[j] for j in sorted(group)),
             tuple(bucket.shapes[j] for j in sorted(group)),
             tuple(bucket.dtypes[j] for j in sorted(group)))
      for group in groups)


# XLA:CPU fuses a concatenation of at most this many arrays into the kernel that
# reads it (jax 0.10.2); one of more is a copy of its own, into a buffer of its own.
FUSED_CONCATENATION = 8


def concat(parts: list[jax.Array]) -> jax.Array:
  """Flat f32 parts end to end (no copy for one part, ``f32[0]`` for none)."""
  if not parts:
    return jnp.zeros((0,), jnp.float32)
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


class Pieces(NamedTuple):
  """New values for some spans of a flat buffer, the rest left as it is.

  Attributes:
    offsets: where each span starts (static ints; spans do not overlap).
    values: one array per span (any shape of the span's size), its new values.
  """

  offsets: tuple[int, ...]
  values: tuple[jax.Array, ...]


class Rewrite(NamedTuple):
  """A flat buffer's new value made from the old one by ``write`` (``f32[n] -> f32[n]``),
  a kernel that takes the buffer in place (a custom call that aliases it): written
  as :class:`Pieces` are, with no copy of the buffer around it.
  """

  write: Callable[[jax.Array], jax.Array]


def overwrite(old: jax.Array, new, keep: Optional[jax.Array] = None) -> jax.Array:
  """``old`` (``f32[n]``) with ``new`` written over it where the bool scalar ``keep`` holds.

  ``new``: ``f32[n]``; or :class:`Pieces`, each written by one
  ``dynamic-update-slice`` over its span of a donated ``old`` in place (no
  concatenation of the pieces into a new buffer); or a :class:`Rewrite`
  of the flat buffer; or a function of no
  arguments that returns either, called where the value is written. With
  ``keep``, on CPU the pieces, and a function's whole computation, sit in a
  conditional (without a collective) that writes them only where ``keep``
  holds, so that no kernel reads ``old`` to keep it: XLA:CPU writes a span
  in place only when the kernel reads nothing else of the buffer (a
  ``where`` between the new and the old values would copy the whole buffer
  once per piece), and a ``where`` over ``f32[n]`` reads all of ``old``;
  the conditional takes the buffer as rows that the pieces fill whole, where
  they have several dimensions (:func:`_row_width`). An ``f32[n]`` computed
  beforehand gets that ``where``: a branch would copy it. Elsewhere the
  ``where`` is fused into each write (a conditional on GPU reads its
  predicate on the host), its read of the old span a dynamic slice at the
  write's own start, which XLA:GPU writes in place.
  ``keep=None``: always written.
  """
  if keep is None:
    return _written(old, _value(new))
  if isinstance(new, jax.Array):
    return _written_selected(old, new, keep)
  return lax.platform_dependent(
      old, cpu=lambda buffer: _written_in_branch(buffer, new, keep),
      default=lambda buffer: _written_selected(buffer, new, keep))


def overwrite_joint(olds: tuple[jax.Array, ...], write: Callable[..., tuple],
                    keep: Optional[jax.Array] = None) -> tuple[jax.Array, ...]:
  """``write(*olds)`` (one new ``f32[n]`` per old buffer, from a kernel that takes them
  in place: a custom call that aliases them) where the bool scalar ``keep`` holds,
  else ``olds``: several buffers written as a :class:`Rewrite` writes one, in one
  conditional on CPU (one kernel reads and writes them all, no copy around it),
  elsewhere through a ``where`` each. ``keep=None``: always written.
  """
  if keep is None:
    return tuple(write(*olds))
  return lax.platform_dependent(
      *olds,
      cpu=lambda *buffers: lax.cond(keep, lambda b: tuple(write(*b)), lambda b: tuple(b),
                                    buffers),
      default=lambda *buffers: tuple(jnp.where(keep, new, old)
                                     for new, old in zip(write(*buffers), buffers)))


def _value(new):
  return new() if callable(new) else new


def _written(buffer: jax.Array, new) -> jax.Array:
  """``new`` written over ``buffer``: ``f32[n]``, or its ``[n / w, w]`` view in which each
  piece is whole rows (:func:`_row_width`)."""
  if isinstance(new, Rewrite):
    return new.write(buffer)
  if not isinstance(new, Pieces):
    return new
  row = buffer.shape[1:]  # () for the flat buffer
  width = math.prod(row)
  for offset, piece in zip(new.offsets, new.values):
    buffer = lax.dynamic_update_slice(buffer, piece.reshape((-1,) + row),
                                      (offset // width,) + (0,) * len(row))
  return buffer


# The widest row of :func:`_row_width`: a piece's loop runs as fast in rows of
# 64 entries as in its own rows (4,608), 6.4x faster than flat (XLA:CPU).
_ROW = 64


def _row_width(length: int, offsets: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> int:
  """Entries per row of the ``[length / w, w]`` view of a buffer of ``length`` in which
  every piece (at ``offsets``, of ``shapes``) is whole rows: the largest power of two
  up to 64 that divides the length, each offset and each piece's last dimension;
  1 (the flat buffer) where no piece has two dimensions or more.

  XLA:CPU writes a piece in place in one loop over the piece as the write
  sees it. Flat, each entry of a piece with several dimensions (a group's
  ``[count, rows, cols]`` of low-rank products) costs divisions for its
  position and a gather from each factor: a ``[8, 512, 4608]`` piece of
  ``M - P Q^T`` at rank 4 took 49 ms written flat, 22 ms in rows of 8 and 7.6
  ms in rows of 64 (the same bits here). The view must be the buffer's own
  shape: a reshape inside the kernel that writes a piece makes XLA:CPU copy
  the buffer.
  """
  if all(len(shape) < 2 for shape in shapes):
    return 1
  return math.gcd(length, _ROW, *offsets, *(shape[-1] if shape else 1 for shape in shapes))


def _written_in_branch(buffer: jax.Array, new, keep: jax.Array) -> jax.Array:
  offsets: list[int] = []

  def values():
    value = _value(new)
    if not isinstance(value, Pieces):
      return None
    offsets.extend(value.offsets)
    return value.values

  shapes = jax.eval_shape(values)  # traced for the pieces' layout only
  width = 1 if shapes is None else _row_width(buffer.shape[0], offsets,
                                              [s.shape for s in shapes])

  # The view enters the conditional as its operand: a reshape outside every kernel.
  view = buffer if width == 1 else buffer.reshape(-1, width)
  return lax.cond(keep, lambda b: _written(b, _value(new)), lambda b: b, view).reshape(-1)


def _written_selected(buffer: jax.Array, new, keep: jax.Array) -> jax.Array:
  new = _value(new)
  if isinstance(new, Rewrite):
    return jnp.where(keep, new.write(buffer), buffer)
  if not isinstance(new, Pieces):
    return jnp.where(keep, new, buffer)
  # XLA:GPU writes a span in place only when the kernel reads nothing else of
  # the buffer than a dynamic-slice with the write's own start. A constant
  # start turns the read into a static slice (the simplifier's), and the
  # kernel then copies the whole buffer: one copy per piece. Behind a barrier
  # the starts stay operands, the same for the read and the write.
  starts = lax.optimization_barrier(tuple(jnp.int32(offset) for offset in new.offsets))
  for start, piece in zip(starts, new.values):
    piece = piece.reshape(-1)
    kept = jnp.where(keep, piece, lax.dynamic_slice(buffer, (start,), piece.shape))
    buffer = lax.dynamic_update_slice(buffer, kept, (start,))
  return buffer


def _fusable(x) -> bool:
  dtype = jnp.dtype(x.dtype)
  return (dtype != jax.dtypes.float0 and jnp.issubdtype(dtype, jnp.floating)
          and math.prod(x.shape) > 0)


def check_leaves(updates: chex.ArrayTree) -> None:
  """A ``TypeError`` naming the first leaf that is complex, integer or not an array.

  Real floating leaves are fused; ``float0`` leaves pass through untouched.
  A complex gradient would lose its imaginary part in an f32 bucket.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(updates):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      raise TypeError(
          f"`updates` leaf {jax.tree_util.keystr(path)} is not an array:"
          f" {type(leaf).__name__}")
    dtype = jnp.dtype(dtype)
    if dtype == jax.dtypes.float0 or jnp.issubdtype(dtype, jnp.floating):
      continue
    what = "complex" if jnp.issubdtype(dtype, jnp.complexfloating) else dtype.name
    raise TypeError(
        f"`updates` leaf {jax.tree_util.keystr(path)} has dtype {dtype.name}: jaxcomp"
        f" compresses real floating gradients (float16, bfloat16, float32, float64);"
        f" {what} gradients are not supported (split a complex parameter into its"
        " real and imaginary parts)")


def scatter_leaves(like: chex.ArrayTree, replaced: dict[int, jax.Array]) -> chex.ArrayTree:
  """``like`` with the leaves at the given positions replaced."""
  leaves, treedef = jax.tree.flatten(like)
  leaves = [replaced.get(i, x) for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, leaves)


def partition(
    tree: chex.ArrayTree, where: Callable[[tuple[int, ...]], bool]
) -> tuple[Bucket, Bucket]:
  """Two buckets: the leaves whose shape satisfies ``where``, and the others."""
  return Bucket.of(tree, where), Bucket.of(tree, lambda s: not where(s))


def check_same_structure(updates: chex.ArrayTree, reference: chex.ArrayTree, what: str) -> None:
  """A clear ``ValueError`` when ``updates`` is not shaped like ``reference``."""
  ref_leaves, ref_def = jax.tree.flatten(reference)
  leaves, treedef = jax.tree.flatten(updates)
  if treedef != ref_def:
    raise ValueError(
        f"`updates` do not have the tree structure of the {what} the state was"
        f" initialised with: got {treedef}, expected {ref_def}"
    )
  for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
    if tuple(a.shape) != tuple(b.shape):
      raise ValueError(
          f"`updates` leaf {i} has shape {tuple(a.shape)}, but the state was"
          f" initialised for shape {tuple(b.shape)}"
      )
