"""Tensor fusion: a gradient pytree as one flat f32 bucket, and back.

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
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp


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
    """The bucket of the leaves of ``tree`` whose shape satisfies ``where`` (all by default)."""
    leaves = jax.tree.leaves(tree)
    chosen = [i for i, x in enumerate(leaves) if where is None or where(tuple(x.shape))]
    return cls(
        leaves=tuple(chosen),
        shapes=tuple(tuple(leaves[i].shape) for i in chosen),
        dtypes=tuple(jnp.dtype(leaves[i].dtype) for i in chosen),
    )

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

  def flatten(self, tree: chex.ArrayTree) -> jax.Array:
    """``f32[size]``: the bucket's leaves of ``tree``, raveled and concatenated."""
    leaves = jax.tree.leaves(tree)
    parts = [leaves[i].reshape(-1).astype(jnp.float32) for i in self.leaves]
    if not parts:
      return jnp.zeros((0,), jnp.float32)
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def split(self, flat: jax.Array) -> list[jax.Array]:
    """The leaves of a flat bucket, in their shapes, still f32."""
    return [
        flat[o:o + n].reshape(s)
        for o, n, s in zip(self.offsets, self.sizes, self.shapes)
    ]

  def unflatten(self, flat: jax.Array, like: chex.ArrayTree) -> chex.ArrayTree:
    """``like`` with the bucket's leaves replaced by ``flat``'s, in their dtypes."""
    return scatter_leaves(like, {i: x.astype(d) for i, x, d in zip(
        self.leaves, self.split(flat), self.dtypes)})


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
