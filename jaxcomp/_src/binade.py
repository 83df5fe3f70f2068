"""Exact rescaling by powers of two: a value brought into ``[1, 2)`` without rounding.

A power of two changes a float's exponent only, so a product or quotient of
rescaled values has the bits of the unscaled one wherever that one neither
overflowed nor underflowed; rescaled first, it does neither. The low-rank
methods bring each factor column into range before its products and
projections, QSGD brings each block's norm into range before the
division by it (XLA may rewrite a division by a broadcast value as a
product with its reciprocal, which underflows to zero, flushed, for a norm
above ``2**126``), and QSGD's and DGC's norms of gradients whose squares
overflow come from the rescaled gradient (:func:`unit_norm`).

Those norms, and signSGD's scale, take the costlier route under a
``lax.cond`` on every backend, so that it runs only for the rare input that
needs it. XLA:GPU reads such a predicate on the host, yet on an H200 the
branch-free form (both routes computed, one picked by ``jnp.where``) was the
slower one: signSGD 1.3-1.5 ms a step against 2.0-2.1, QSGD 1.4-1.5 against
2.1-2.2 (ResNet-50's gradient, one bucket, two runs of each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def unit_factor(top: jax.Array) -> jax.Array:
  """The power of two ``f`` (f32, shaped like ``top``) with ``f * |top|`` in ``[1, 2)``.

  ``top``: f32, any shape. ``f`` stays a normal float (XLA:CPU flushes
  subnormals to zero), so the top binade (``|top| >= 2**127``) lands in
  ``[2, 4)``; ``top`` 0 or subnormal gets ``2**127`` (``f * |top| < 2``);
  an Inf or NaN ``top`` gets ``2**-126`` and stays Inf or NaN.
  """
  biased = lax.shift_right_logical(lax.bitcast_convert_type(jnp.abs(top), jnp.int32), 23)
  # 2**(127 - e) takes the binade [2**(e - 127), 2**(e - 126)) to [1, 2).
  exponent = jnp.clip(254 - biased, 1, 254)
  return lax.bitcast_convert_type(lax.shift_left(exponent, 23), jnp.float32)


def unit_norm(x: jax.Array, axis=None) -> tuple[jax.Array, jax.Array]:
  """``(f, ||f x||)``: :func:`unit_factor` of ``x``'s largest ``|entry|`` along ``axis``
  (all of ``x`` for ``None``) and the L2 norm of ``x`` times it, along ``axis``.

  ``||x|| = ||f x|| / f`` exactly, but ``||f x||`` never overflows (its
  squares are at most 16 each) where the squares of ``x`` do (entries past
  1.8e19), so it gives the direction ``f x / ||f x||`` of any finite ``x``.
  """
  f = unit_factor(jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None))
  scaled = x * f
  norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=axis))
  return (f if axis is None else jnp.squeeze(f, axis)), norm
