"""Error feedback: what a compressor did not send this step is added to the next.

With ``c = g + e`` the corrected gradient, ``s`` what this device sent (its
contribution, decompressed) and ``e' = c - s`` the new residual, mass is
conserved: ``s + e' == g + e``. The residual is a pytree shaped like the
parameters, in f32, one per device. :mod:`jaxcomp.protocol` applies it for
every method; a method only says what stays behind.

Summation order, fixed and tested: leaves are raveled and concatenated in the
bucket's order and cast to f32, ``c = flat(g) + flat(e)`` element by element,
``e' = c - s``. For a sparse ``s`` (``c`` where sent, 0 elsewhere) ``s + e'``
equals ``c`` bit for bit.

References:
  Seide et al., 1-bit SGD, Interspeech 2014; Karimireddy et al., `Error
  Feedback Fixes SignSGD and other Gradient Compression Schemes
  <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import fusion


def init(params: optax.Params) -> optax.Params:
  """A zero residual per leaf, f32, shaped like ``params``."""
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)


def compensate(bucket: fusion.Bucket, updates: optax.Updates, residual: optax.Params) -> jax.Array:
  """``f32[bucket.size]``: the bucket's gradients plus their residual."""
  # Summed leaf by leaf, then concatenated once: the same sums, without two
  # concatenated n-sized buffers beside the result.
  return fusion.concat([c.reshape(-1) for c in compensated_leaves(bucket, updates, residual)])


def compensated_leaves(bucket: fusion.Bucket, updates: optax.Updates,
                       residual: optax.Params) -> list[jax.Array]:
  """The bucket's leaves of ``g + e``, f32, each in its leaf's shape (the same sums)."""
  leaves = jax.tree.leaves(updates)
  return add_residual(bucket, [leaves[i].astype(jnp.float32) for i in bucket.leaves], residual)


def add_residual(bucket: fusion.Bucket, parts: Sequence[jax.Array],
                 residual: optax.Params) -> list[jax.Array]:
  """``parts`` (one f32 array per bucket leaf, in the bucket's order, any shape
  of the leaf's size) plus their leaves' residual, in the parts' shapes."""
  residuals = jax.tree.leaves(residual)
  return [p + residuals[i].reshape(p.shape) for i, p in zip(bucket.leaves, parts)]


def sent_mask(n: int, indices: jax.Array) -> jax.Array:
  """``bool[n]``: true at ``indices`` (any shape; ``EMPTY_INDEX`` slots dropped)."""
  return jnp.zeros(n, jnp.bool_).at[indices.reshape(-1)].set(True, mode="drop")


def zero_sent(sent: Sequence[jax.Array], parts: Sequence[jax.Array]) -> list[jax.Array]:
  """Each of ``parts`` with 0 where its piece of the ``sent`` mask is true (shapes alike)."""
  return [jnp.where(m.reshape(x.shape), jnp.zeros((), x.dtype), x) for m, x in zip(sent, parts)]


def zeroed(bucket: fusion.Bucket, corrected: Sequence[jax.Array],
           indices: jax.Array) -> list[jax.Array]:
  """``corrected``, the bucket's leaves of ``c``, with the entries at ``indices`` set to 0.

  What a sparsifier keeps, ``e' = c`` but 0 where it sent exactly. Built leaf
  by leaf through an ``n``-byte mask (``EMPTY_INDEX`` slots dropped), so the
  ``n``-sized ``c`` is neither copied nor scattered into. Given in the
  leaves' shapes (:func:`compensated_leaves`), each new residual reads its
  old one element by element, and XLA updates it in place.
  """
  return zero_sent(bucket.split(sent_mask(bucket.size, indices)), corrected)


Kept = Union[jax.Array, Sequence[Optional[jax.Array]]]


def absorb(bucket: fusion.Bucket, kept: Kept, residual: optax.Params) -> optax.Params:
  """``residual`` with the bucket's leaves set to what stays behind.

  Args:
    bucket: the fused leaves.
    kept: ``f32[bucket.size]``, the new residual of the whole bucket
      (``corrected - sent``; for a sparse send, ``corrected`` with the sent
      entries zeroed: a scatter, not two more ``n``-sized buffers); or one
      array per bucket leaf (any shape of the leaf's size), ``None`` for a
      leaf whose residual stays as it is (one the method sends exactly).
    residual: the residual pytree to update.
  """
  if not isinstance(kept, (list, tuple)):
    kept = bucket.split(kept)
  return fusion.scatter_leaves(residual, {
      i: k.reshape(s) for i, k, s in zip(bucket.leaves, kept, bucket.shapes) if k is not None})


def check_matches(updates: chex.ArrayTree, residual: chex.ArrayTree) -> None:
  """A clear ``ValueError`` when ``updates`` are not shaped like the state's parameters."""
  fusion.check_same_structure(updates, residual, "parameters")
