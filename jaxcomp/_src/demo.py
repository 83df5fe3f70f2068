"""DeMo's compressor: the largest DCT coefficients of every chunk, error feedback that decays."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import collectives
from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import wire

MAX_CHUNK = 256  # positions travel as uint8
_VALUE_BYTES, _INDEX_BYTES = 4, 1


class DeMoState(NamedTuple):
  """State of :func:`demo`.

  Attributes:
    count: steps taken (int32, saturating).
    residual: ``f32[n]``, the gradient's leaves fused in tree order (a tuple
      of one per bucket with ``bucket_cap_mb``): ``error_decay`` times what
      this device did not send, DeMo's momentum less what it sent.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]


def dct_matrix(size: int) -> jax.Array:
  """The orthonormal DCT-II matrix ``D`` (``f32[size, size]``): ``X = D x``, ``x = D^T X``.

  ``D[k, j] = sqrt(2 / size) c_k cos(pi (2 j + 1) k / (2 size))``, ``c_0 = 1 / sqrt(2)``,
  ``c_k = 1`` otherwise.
  """
  k = np.arange(size)[:, None]
  j = np.arange(size)[None, :]
  d = np.sqrt(2.0 / size) * np.cos(np.pi * (2 * j + 1) * k / (2 * size))
  d[0] /= np.sqrt(2.0)
  return jnp.asarray(d, jnp.float32)


# The inverse DCT of a chunk that holds ``t`` coefficients is a sum of ``t``
# rows of the basis, ``t`` multiply-adds per entry against ``C`` for the
# densified chunk times the basis; the sum is taken while ``t`` is at most
# ``C / 8`` (on XLA:CPU, 52 against 93 ms for ResNet-50's 25.6M entries at
# ``t = 1``, 83 against 143 at ``t = 8``; even near ``t = C / 4``).
_SUM_SHARE = 8


def inverse_of_sparse(values: jax.Array, positions: jax.Array, inverse: jax.Array) -> jax.Array:
  """``f32[chunks * C]``: the chunks whose only nonzero coefficients are ``values`` at
  ``positions``, each times ``inverse`` (``f32[C, C]``).

  ``values`` f32 and ``positions`` (any int dtype, in ``[0, C)``) are
  ``[..., chunks, k]``: the leading axes (devices) add up. Chunk ``c`` is
  ``sum over the leading axes and j of values[..., c, j] inverse[positions[..., c, j]]``,
  as a sum of rows when there are few terms (no ``chunks x C`` buffer of
  zeros, no product with ``inverse``), else densified and multiplied.
  """
  chunk = inverse.shape[0]
  chunks, k = values.shape[-2:]
  if values.size // chunks * _SUM_SHARE > chunk:
    dense = collectives.densify(values, selection.flat_positions(positions, chunk), chunks * chunk)
    return (dense.reshape(chunks, chunk) @ inverse).reshape(-1)
  values = values.reshape(-1, chunks, k)
  positions = positions.reshape(values.shape).astype(jnp.int32)
  terms = [values[d, :, j, None] * inverse[positions[d, :, j]]
           for d in range(values.shape[0]) for j in range(k)]
  return sum(terms[1:], terms[0]).reshape(-1)


def inverse_per_leaf(values: jax.Array, positions: jax.Array, inverse: jax.Array,
                     bucket: fusion.Bucket) -> list[jax.Array]:
  """:func:`inverse_of_sparse` cut into ``bucket``'s leaves (``f32[size]`` each, at
  ``bucket.offsets``), the same values.

  With few terms each piece is its own sum of rows over the chunks it
  touches: one kernel per leaf that reads its chunks' coefficients and writes
  the leaf, where the whole bucket's inverse would be written once and read
  again by each leaf's slice (2 passes over the gradient more). With many,
  the whole product is sliced.
  """
  chunk = inverse.shape[0]
  chunks, k = values.shape[-2:]
  spans = list(zip(bucket.offsets, bucket.sizes))
  if values.size // chunks * _SUM_SHARE > chunk:
    flat = inverse_of_sparse(values, positions, inverse)
    return [flat[start:start + size] for start, size in spans]
  pieces = []
  for start, size in spans:
    first, stop = start // chunk, -(-(start + size) // chunk)
    inverted = inverse_of_sparse(values[..., first:stop, :], positions[..., first:stop, :],
                                 inverse)
    pieces.append(inverted[start - first * chunk:start - first * chunk + size])
  return pieces


def message_bytes(n: int, chunk_size: int, density: float) -> int:
  """Bytes of one device's message for ``n`` entries: per chunk, ``k`` f32 coefficients and
  ``k`` uint8 positions."""
  _, chunks, k = selection.chunks(n, chunk_size, density)
  return chunks * k * (_VALUE_BYTES + _INDEX_BYTES)


def demo(
    density: float,
    axis_name: checks.AxisName,
    *,
    chunk_size: int = 64,
    error_decay: float = 0.999,
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """DeMo: the ``k`` largest DCT-II coefficients of every chunk, error feedback that decays.

  The fused gradient is cut into chunks of ``C`` entries (``chunk_size``, at
  most the gradient's size; the last one zero-padded). With ``e`` this
  device's residual, ``c = g + e``; each chunk goes through the orthonormal
  DCT-II (:func:`dct_matrix`) scaled by ``1 / sqrt(C)`` (the first
  coefficient is the chunk's mean), its ``k = max(1, ceil(density C))``
  coefficients of largest magnitude are sent as f32 with their uint8
  positions, in one all-gather; every device averages every device's
  coefficients and takes the inverse DCT. What this device did not send
  stays behind, decayed: ``e' = error_decay * (c - s)``, ``s`` the inverse
  DCT of its own coefficients, so that ``e`` is DeMo's momentum ``m = beta
  m + g`` less what it sent (Peng, Quesnelle and Kingma, Decoupled Momentum
  Optimization, arXiv:2411.19870). DeMo applies the sign of the mean:
  ``optax.chain(jaxcomp.demo(...), optax.scale_by_sign(), optax.sgd(lr))``,
  or any optimizer after it.

  On CPU, where the native custom calls sum a bucket of two f32 leaves or
  more and ``C`` is a power of two (64 by default), one call forms ``c``
  from the leaves and the residual a few chunks at a time in cache, takes
  each chunk's transform by Lee's fast DCT (``C log2(C) / 2`` products a
  chunk, where the matrix takes ``C^2``) and picks its ``k`` coefficients,
  writing nothing of ``n`` entries (:func:`jaxcomp._src.native.dct_topk`);
  once the step is kept one more forms ``c`` again and writes ``e'`` over
  ``e`` in place (:func:`jaxcomp._src.native.dct_residual`). Lee's sums run
  in another order than the matrix product's: the coefficients agree to
  rounding (about ``2e-6`` of the chunk's largest), not bit for bit.

  Args:
    density: share of each chunk's coefficients sent, in (0, 1].
    axis_name: the mesh axis, or a pair of axes (one all-gather over both).
    chunk_size: entries per chunk, an int in ``[1, 256]`` (positions are
      uint8).
    error_decay: ``beta``, in [0, 1].
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf) (:func:`jaxcomp.protocol.plan`); each bucket is
      chunked on its own.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`DeMoState`,
    whose ``update`` returns the mean, identical on every device, in the
    dtype of ``updates``.

  Wire: one all-gather of ``M = chunks * 5 k`` bytes from each device,
  ``(P - 1) M`` bytes per device (:func:`message_bytes`): at ``density``
  1/32 with ``C = 64``, 0.16 bytes per entry against the dense all-reduce's
  ``8 (P - 1) / P``.
  """
  density, chunk_size, error_decay, bucket_cap_mb = checks.check_chunked(
      density, chunk_size, MAX_CHUNK, error_decay, bucket_cap_mb)
  axes = checks.check_axis_name(axis_name)

  def prepare_leaves(ctx, leaves, state):
    """Where the native custom calls sum the bucket and the chunk is a power of two,
    nothing is formed before the step: its calls read the leaves (the carry) and the
    residual where they lie (:func:`jaxcomp._src.native.dct_topk`,
    :func:`jaxcomp._src.native.dct_residual`). Else ``None``: error feedback forms the
    corrected gradient, padded to whole chunks, as for any method."""
    del state
    chunk, _, _ = selection.chunks(ctx.bucket.size, chunk_size, density)
    return (None, leaves) if chunk & (chunk - 1) == 0 else None

  def step(ctx, corrected, state):
    n = ctx.bucket.size
    chunk, chunks, k = selection.chunks(n, chunk_size, density)
    leaves = ctx.carry
    # The DCT scaled by 1 / sqrt(C): each coefficient at most the chunk's largest
    # magnitude, so that any finite gradient has finite coefficients.
    basis = dct_matrix(chunk)
    forward, inverse = basis / np.sqrt(chunk), basis * np.sqrt(chunk)
    if leaves is not None:
      coefficients, positions = native.dct_topk(leaves, state.residual, chunk, k)
    else:
      # ``corrected`` comes padded to whole chunks (``flat_length``).
      coefficients, positions = selection.topk_per_row_of_product(
          corrected.reshape(chunks, chunk), forward.T, k)
    values = ctx.send(coefficients)
    gathered_values, gathered_positions = collectives.allgather(values, ctx.axes), ctx.allgather(
        positions.astype(jnp.uint8))
    mean = inverse_per_leaf(gathered_values, gathered_positions, inverse, ctx.bucket)

    def kept():
      if leaves is not None:
        return fusion.Rewrite(lambda old: native.dct_residual(
            leaves, old, coefficients, positions, inverse, error_decay))
      sent = inverse_of_sparse(coefficients, positions, inverse)
      return error_decay * (corrected - sent)[:n]

    return protocol.Output(mean=mean, residual=kept, witness=gathered_values)

  def wire_cost(bucket, sizes, steps):
    del steps
    _, chunks, k = selection.chunks(bucket.size, chunk_size, density)
    return (wire.allgather(chunks * k * _VALUE_BYTES, sizes)
            + wire.allgather(chunks * k * _INDEX_BYTES, sizes))

  return protocol.compressor(protocol.Method(
      name="demo",
      config=dict(density=density, axis_name=axis_name, chunk_size=chunk_size,
                  error_decay=error_decay, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=DeMoState, step=step, wire=wire_cost, error_feedback=True,
      prepare_leaves=prepare_leaves, payload_carries_nonfinite=True,
      bucket_cap_mb=bucket_cap_mb, flat_length=selection.chunked_length(chunk_size, density)))
