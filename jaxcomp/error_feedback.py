"""Error feedback: what a compressor did not send this step is added to the next.

With ``c = g + e`` the corrected gradient, ``s`` what this device sent (its
contribution, decompressed) and ``e' = c - s`` the new residual, mass is
conserved: ``s + e' == g + e``. The residual is a pytree shaped like the
parameters, in f32, one per device.

Summation order, fixed and tested: leaves are raveled and concatenated in
``jax.tree.leaves`` order and cast to f32, ``c = flat(g) + flat(e)`` element
by element, ``e' = c - s``. For a sparse ``s`` (``c`` where sent, 0 elsewhere)
``s + e'`` equals ``c`` bit for bit.

References:
  Seide et al., 1-bit SGD, Interspeech 2014; Karimireddy et al., `Error
  Feedback Fixes SignSGD and other Gradient Compression Schemes
  <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax

from jaxcomp import fusion


def init(params: optax.Params) -> optax.Params:
  """A zero residual per leaf, f32, shaped like ``params``."""
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)


def compensate(bucket: fusion.Bucket, updates: optax.Updates, residual: optax.Params) -> jax.Array:
  """``f32[bucket.size]``: the bucket's gradients plus their residual."""
  # Summed leaf by leaf, then concatenated once: the same sums, without two
  # concatenated n-sized buffers beside the result.
  return bucket.flatten(jax.tree.map(
      lambda g, e: g.astype(jnp.float32) + e, updates, residual))


def absorb(
    bucket: fusion.Bucket, corrected: jax.Array, sent: jax.Array, residual: optax.Params
) -> optax.Params:
  """``residual`` with the bucket's leaves set to ``corrected - sent`` (f32)."""
  return fusion.scatter_leaves(
      residual, dict(zip(bucket.leaves, bucket.split(corrected - sent)))
  )


def absorb_sent(
    bucket: fusion.Bucket, corrected: jax.Array, indices: jax.Array, residual: optax.Params
) -> optax.Params:
  """:func:`absorb` of a sparse ``sent``: ``corrected`` at ``indices``, 0 elsewhere.

  ``corrected - sent`` is then ``corrected`` with those entries zeroed
  (``c - c`` is 0, ``c - 0`` is ``c``), so it is a scatter of zeros into
  ``corrected``, not two more ``n``-sized buffers (the dense ``sent`` and the
  difference), each of which costs a pass and, fresh every step, a page fault
  per 4 KiB. Empty slots (index ``collectives.EMPTY_INDEX``, past ``n``) are
  dropped.

  Args:
    bucket: the fused leaves.
    corrected: ``f32[bucket.size]``, the gradient plus the old residual.
    indices: ``int32[k]``, the coordinates sent with their ``corrected`` values.
    residual: the residual pytree to update.
  """
  kept = corrected.at[indices].set(0.0, mode="drop")
  return fusion.scatter_leaves(residual, dict(zip(bucket.leaves, bucket.split(kept))))


def absorb_leaves(
    bucket: fusion.Bucket, corrected: jax.Array, sent: list[jax.Array], residual: optax.Params
) -> optax.Params:
  """:func:`absorb` of a ``sent`` given leaf by leaf (any shape of each leaf's size).

  The low-rank methods make ``sent`` one product per leaf; each leaf of the
  residual is then ``corrected - sent`` directly, without concatenating
  ``sent`` into one more ``n``-sized buffer.
  """
  kept = [c - s.reshape(c.shape) for c, s in zip(bucket.split(corrected), sent)]
  return fusion.scatter_leaves(residual, dict(zip(bucket.leaves, kept)))


def check_matches(updates: chex.ArrayTree, residual: chex.ArrayTree) -> None:
  """A clear ``ValueError`` when ``updates`` are not shaped like the state's parameters."""
  fusion.check_same_structure(updates, residual, "parameters")
