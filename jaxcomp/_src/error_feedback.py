"""Error feedback: what a compressor did not send this step is added to the next.

With ``c = g + e`` the corrected gradient, ``s`` what this device sent (its
contribution, decompressed) and ``e' = c - s`` the new residual, mass is
conserved: ``s + e' == g + e``. The residual is one flat f32 buffer per
bucket, ``f32[bucket.size]`` in the bucket's order (the method's layout), one
per device, so that adding it is one kernel for the whole bucket, and writing
what stays behind one kernel for the bucket or for each span that changes
(written in place, :func:`jaxcomp._src.fusion.overwrite`), not one per leaf.
:mod:`jaxcomp.protocol` applies it for every method; a method only says what
stays behind.

Summation order, fixed and tested: leaves are raveled and concatenated in the
bucket's order and cast to f32, ``c = flat(g) + e`` element by element,
``e' = c - s``. For a sparse ``s`` (``c`` where sent, 0 elsewhere) ``s + e'``
equals ``c`` bit for bit.

References:
  Seide et al., 1-bit SGD, Interspeech 2014; Karimireddy et al., `Error
  Feedback Fixes SignSGD and other Gradient Compression Schemes
  <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import selection


def init(bucket: fusion.Bucket) -> jax.Array:
  """A zero residual for ``bucket``: ``f32[bucket.size]``."""
  return jnp.zeros((bucket.size,), jnp.float32)


# Mask bits per word of :func:`sent_mask`.
_WORD = 32


def sent_mask(n: int, indices: jax.Array, sent_from: Optional[int] = None) -> jax.Array:
  """``uint32[ceil(n / 32)]``: bit ``i % 32`` of word ``i // 32`` set for each position
  ``i`` of ``indices`` (any shape, its positions in ``[0, n)`` distinct and below
  ``sent_from``; ``EMPTY_INDEX`` slots dropped), and for every position from
  ``sent_from`` on.

  Packed, not an ``n``-byte ``bool`` mask: on XLA:CPU that mask is new memory
  on every step (its first writes fault its pages in) and read again by each
  :func:`zero_sent`; this one is a thirty-second of it (ResNet-50 top-k
  steps 5-12 ms shorter). Distinct positions set distinct bits, so a sum of
  them is their union. Where the native custom calls run
  (:func:`jaxcomp._src.selection.native_route`, on CPU), one custom call
  writes it (:func:`jaxcomp._src.native.sent_mask`, the same bits): one
  kernel, where XLA:CPU makes four of the scatter (the words of the dense
  positions, each index's word and bit, the scatter itself).
  """
  if selection.native_route():
    return native.sent_mask(n, indices, sent_from)
  words = -(-n // _WORD)
  if sent_from is None or sent_from >= n:
    mask = jnp.zeros(words, jnp.uint32)
  else:
    # Word w's bits at positions >= sent_from: all of them, none, or the top of one word.
    shift = jnp.clip(sent_from - jnp.arange(words, dtype=jnp.int32) * _WORD, 0, _WORD)
    mask = jnp.where(shift >= _WORD, jnp.uint32(0),
                     jnp.left_shift(jnp.uint32(0xFFFFFFFF),
                                    jnp.minimum(shift, _WORD - 1).astype(jnp.uint32)))
  flat = indices.reshape(-1)
  word = jnp.where((flat >= 0) & (flat < n), flat // _WORD, words)
  bit = jnp.left_shift(jnp.uint32(1), (flat % _WORD).astype(jnp.uint32))
  return mask.at[word].add(bit, mode="drop", wrap_negative_indices=False)


def zero_sent(sent: jax.Array, x: jax.Array) -> jax.Array:
  """``x`` (``f32[n]``) with 0 where :func:`sent_mask`'s ``sent`` (of at least ``n``
  positions) has its bit set."""
  n = x.shape[0]
  bits = (sent[:, None] >> jnp.arange(_WORD, dtype=jnp.uint32)) & 1
  return jnp.where(bits.reshape(-1)[:n] != 0, jnp.zeros((), x.dtype), x)


def zeroed(corrected: jax.Array, indices: jax.Array) -> jax.Array:
  """``corrected`` (``f32[n]``) with the entries at ``indices`` (distinct) set to 0.

  What a sparsifier keeps, ``e' = c`` but 0 where it sent exactly: one
  kernel through a packed mask of the positions (:func:`sent_mask`), which
  XLA writes over the old residual in place.
  """
  return zero_sent(sent_mask(corrected.shape[0], indices), corrected)


Kept = Union[jax.Array, Sequence[Optional[jax.Array]], fusion.Pieces, fusion.Rewrite]


def absorb(bucket: fusion.Bucket, kept: Kept) -> Union[jax.Array, fusion.Pieces, fusion.Rewrite]:
  """The bucket's new residual: ``f32[bucket.size]``, or the :class:`jaxcomp.protocol.Pieces`
  of it that change, written over the old residual by :func:`jaxcomp._src.fusion.overwrite`.

  Args:
    bucket: the fused leaves.
    kept: ``f32[bucket.size]``, what stays behind (``corrected - sent``);
      or one array per bucket leaf (any shape of the leaf's size), ``None``
      for a leaf whose residual stays as it is (one the method sends
      exactly); or :class:`jaxcomp.protocol.Pieces`, or a
      :class:`jaxcomp._src.fusion.Rewrite` of the old residual.
  """
  if isinstance(kept, (fusion.Pieces, fusion.Rewrite)):
    return kept
  if not isinstance(kept, (list, tuple)):
    return kept.reshape(-1)
  spans = [(o, k) for k, o in zip(kept, bucket.offsets) if k is not None]
  return fusion.Pieces(tuple(o for o, _ in spans), tuple(k for _, k in spans))


def check_matches(buckets: Sequence[fusion.Bucket], residual) -> None:
  """A clear ``ValueError`` when the residuals were not made for these buckets.

  ``residual``: ``f32[n]`` for one bucket, one per bucket for several.
  """
  residuals = residual if isinstance(residual, (list, tuple)) else (residual,)
  got = tuple(tuple(jnp.shape(r)) for r in residuals)
  want = tuple((b.size,) for b in buckets)
  if got != want:
    raise ValueError(
        "`updates` are not shaped like the parameters the state was initialised"
        f" with: their buckets hold {[b.size for b in buckets]} elements, the"
        f" state's residuals {[s[0] if len(s) == 1 else s for s in got]}")
