"""Counter-based random draws: elementwise integer hashing of a position and two key words.

``jax.random`` runs threefry's rounds as a loop of their own on CPU (scalar
copies each round, and for ``n`` draws its passes over ``n`` words); a draw
here is ``mix(mix(i ^ w0) ^ w1)`` for position ``i``, where ``w0, w1`` are two
words drawn once from the key and ``mix`` is a bijective 32-bit hash, so XLA
fuses it into whatever reads it. Not for cryptography: for rounding noise
and sample positions.

Reference:
  C. Wellons, `Prospecting for Hash Functions
  <https://nullprogram.com/blog/2018/07/31/>`_, 2018 (lowbias32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _mix(x: jax.Array) -> jax.Array:
  """lowbias32: a bijective 32-bit integer hash with a low bias."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def bits(key: jax.Array, n: int) -> jax.Array:
  """``uint32[n]``: entry ``i`` is ``mix(mix(i ^ w[0]) ^ w[1])``, ``w`` two words of ``key``."""
  words = jax.random.bits(key, (2,), jnp.uint32)
  return _mix(_mix(lax.iota(jnp.uint32, n) ^ words[0]) ^ words[1])


def uniform(key: jax.Array, n: int) -> jax.Array:
  """``f32[n]``, uniform on ``[0, 1)`` in steps of ``2**-24``: the top 24 of :func:`bits`."""
  return (bits(key, n) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def integers(key: jax.Array, n: int, high: int) -> jax.Array:
  """``int32[n]`` in ``[0, high)``, ``1 <= high <= 2**31``: :func:`bits` modulo ``high``.

  The modulo favours the low values by at most ``high / 2**32`` (relative):
  nothing for a sample's positions.
  """
  if not 1 <= high <= 2**31:
    raise ValueError(f"`high` must be in [1, 2**31], got {high}")
  return (bits(key, n) % jnp.uint32(high)).astype(jnp.int32)
