"""Counter-based random draws: elementwise integer hashing of a position and two key words.

``jax.random`` runs threefry's rounds as a loop of their own on CPU (scalar
copies each round, about 26 kernels per call, and for ``n`` draws its passes
over ``n`` words); a draw here is ``mix(mix(i ^ w0) ^ w1)`` for position
``i`` (:func:`uniform`, one per entry of a gradient, is one round,
``mix(i ^ w0) ^ w1``), where ``w0, w1`` are hashed from the key's own two data
words (no threefry call at all) and ``mix`` is a bijective 32-bit hash, so
XLA fuses it into whatever reads it. A ``stream`` gives one key several
independent draws (a device's, a hop's): it is hashed into ``w0``. New keys
come the same way (:func:`derive`, :func:`step_keys`): the shared path's
per-step key split makes no threefry call either. Not for cryptography: for
rounding noise and sample positions.

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


def bits(key: jax.Array, n: int, stream=0) -> jax.Array:
  """``uint32[n]``: entry ``i`` is ``mix(mix(i ^ w0) ^ w1)``, :func:`bits_at` of ``0, ..., n - 1``."""
  return bits_at(key, lax.iota(jnp.uint32, n), stream)


def bits_at(key: jax.Array, counters: jax.Array, stream=0) -> jax.Array:
  """``uint32`` of ``counters``' shape: entry ``i`` of :func:`bits` for each counter ``i``.

  With ``d0, d1`` the key's first two data words and ``stream`` an int32
  scalar ``>= 0`` (traced or not): ``mix(mix(i ^ w0) ^ w1)``, ``w0 = mix(d0 ^
  mix(0x9E3779B9 (stream + 1)))`` and ``w1 = mix(d1 ^ 0x85EBCA6B)`` (uint32
  arithmetic), so that each stream of one key draws its own values, and a key
  of zeros no zeros. A few chosen entries are drawn without the ones before
  them.
  """
  first, second = words(key, stream)
  return _mix(_mix(jnp.asarray(counters).astype(jnp.uint32) ^ first) ^ second)


def words(key: jax.Array, stream) -> tuple[jax.Array, jax.Array]:
  """``(w0, w1)`` of :func:`bits_at`: uint32 scalars of the key's data words and the stream
  (what a native kernel that draws as :func:`uniform` takes)."""
  data = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  salt = jnp.uint32(0x9E3779B9) * (jnp.asarray(stream).astype(jnp.uint32) + jnp.uint32(1))
  return _mix(data[0] ^ _mix(salt)), _mix(data[1] ^ jnp.uint32(0x85EBCA6B))


def derive(key: jax.Array, stream=0) -> jax.Array:
  """A key of ``key``'s implementation whose data words are ``bits(key, words, stream)``.

  Stands in for ``jax.random.fold_in(key, stream)`` (and, with two streams,
  for ``jax.random.split``) at the cost of one elementwise hash. Only the
  first two data words of ``key`` feed it (all of a threefry key's).
  """
  data = jax.random.key_data(key)
  words = bits(key, data.size, stream).reshape(data.shape).astype(data.dtype)
  return jax.random.wrap_key_data(words, impl=jax.random.key_impl(key))


def step_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(next key, this step's draw)``: streams 1 and 0 of ``key`` (:func:`derive`)."""
  return derive(key, 1), derive(key, 0)


def uniform(key: jax.Array, n: int, stream=0) -> jax.Array:
  """``f32[n]``, uniform on ``[0, 1)`` in steps of ``2**-24``: the top 24 bits of
  ``mix(i ^ w0) ^ w1`` (:func:`bits_at`'s words), one round of the hash.

  QSGD draws one per entry of the gradient and per hop; the second round of
  :func:`bits` was about a seventh of the kernels that draw them (ResNet-50,
  one CPU device, the kernels that hash: 119 to 126 thread-ms a step with two
  rounds, 100 to 110 with one, in paired runs; ``experiments.kernel_times``).
  One round of lowbias32 already passes the tests of ``tests/test_draws.py``
  (equidistribution, neighbours and streams uncorrelated). As with two
  rounds, stream ``s``'s draw at ``i`` is stream ``t``'s at ``i ^ d`` for a
  fixed ``d``: one value rounds two different entries, which are unrelated.
  """
  first, second = words(key, stream)
  word = _mix(lax.iota(jnp.uint32, n) ^ first) ^ second
  return (word >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def integers(key: jax.Array, n: int, high: int) -> jax.Array:
  """``int32[n]`` in ``[0, high)``, ``1 <= high <= 2**31``: :func:`bits` modulo ``high``.

  The modulo favours the low values by at most ``high / 2**32`` (relative):
  nothing for a sample's positions.
  """
  return integers_at(key, lax.iota(jnp.uint32, n), high)


def integers_at(key: jax.Array, counters: jax.Array, high: int) -> jax.Array:
  """``int32`` of ``counters``' shape: entry ``i`` of :func:`integers` for each counter ``i``."""
  if not 1 <= high <= 2**31:
    raise ValueError(f"`high` must be in [1, 2**31], got {high}")
  return (bits_at(key, counters) % jnp.uint32(high)).astype(jnp.int32)
