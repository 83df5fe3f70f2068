"""SparseLoCo's compressor: top-k in every chunk, 2-bit values, error feedback that decays."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import checks
from jaxcomp._src import collectives
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import wire

_LEVEL_BYTES = 8  # two f32 magnitudes per chunk
_INDEX_BYTES = 2  # a position inside a chunk of at most 2**16 entries
MAX_CHUNK = 2 ** 16


class SparseLoCoState(NamedTuple):
  """State of :func:`sparseloco`.

  Attributes:
    count: steps taken (int32, saturating).
    residual: ``f32[n]``, the gradient's leaves fused in tree order (a tuple
      of one per bucket with ``bucket_cap_mb``): ``error_decay`` times what
      this device did not send, added to its next gradient.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]


def message_bytes(n: int, chunk_size: int, density: float) -> int:
  """Bytes of one device's message for ``n`` entries: per chunk, ``k`` 2-bit codes, ``k``
  uint16 positions and two f32 magnitudes."""
  _, chunks, k = selection.chunks(n, chunk_size, density)
  return chunks * (-(-k // 4) + _INDEX_BYTES * k + _LEVEL_BYTES)


def encode(x: jax.Array, chunk: int, k: int):
  """``(codes, positions, levels, values)`` of a flat ``x`` of ``chunks * chunk`` entries
  (:func:`encoded`'s first four).
  """
  return encoded(x, chunk, k)[:4]


def encoded(x: jax.Array, chunk: int, k: int):
  """``(codes, positions, levels, values, flat)`` of a flat ``x`` of ``chunks * chunk`` entries.

  Per chunk: the ``k`` entries of largest magnitude (``positions``,
  ``uint16[chunks, k]``, the lowest position first on a tie); their
  magnitudes split at the midpoint of the smallest and the largest, each
  side sent as its mean magnitude (``levels``, ``f32[chunks, 2]``: low,
  high; low is high when nothing falls below), so that each side's sum of
  magnitudes is exact; each entry as a 2-bit code, bit 0 its sign (set:
  negative), bit 1 its side (set: high), four codes per byte, the first in
  the lowest bits (``codes``, ``uint8[chunks, ceil(k / 4)]``). ``values``:
  the decoded entries, ``f32[chunks, k]``. ``flat``: the positions in ``x``,
  ``int32[chunks, k]`` (:func:`jaxcomp._src.selection.flat_positions`).

  Where the per-chunk top k is the native custom call, so is all of this
  (:func:`jaxcomp._src.native.two_level`): one kernel, where XLA:CPU makes about
  ten small ones of the ``[chunks, k]`` arrays per gradient bucket.
  """
  rows = x.reshape(-1, chunk)
  if selection.native_rows(rows, k):
    return native.two_level(rows, k)
  picked, positions = selection.topk_per_row(rows, k)
  magnitude = jnp.abs(picked)
  # Halves before the sum, shares before the sums: finite for any finite input.
  middle = (_fold_columns(magnitude, jnp.minimum) / 2
            + _fold_columns(magnitude, jnp.maximum) / 2)[:, None]
  high = magnitude >= middle
  high_count = _fold_columns(high.astype(jnp.int32), jnp.add)[:, None]
  low_count = k - high_count
  # Each share as a product with the reciprocal of the count, which XLA:CPU made of
  # the quotient itself: the same bits on every backend and in the native call.
  high_share = 1 / high_count.astype(jnp.float32)
  low_share = 1 / jnp.maximum(low_count, 1).astype(jnp.float32)
  high_level = _fold_columns(jnp.where(high, magnitude * high_share, 0.0), jnp.add)
  low_level = jnp.where(low_count[:, 0] > 0, _fold_columns(
      jnp.where(high, 0.0, magnitude * low_share), jnp.add), high_level)
  levels = jnp.stack([low_level, high_level], axis=1)
  negative = picked < 0
  code = negative.astype(jnp.uint8) | (high.astype(jnp.uint8) << 1)
  values = _decoded(code, levels)
  padded = jnp.pad(code, ((0, 0), (0, -k % 4))).reshape(code.shape[0], -1, 4)
  codes = padded[..., 0] | (padded[..., 1] << 2) | (padded[..., 2] << 4) | (padded[..., 3] << 6)
  return (codes, positions.astype(jnp.uint16), levels, values,
          selection.flat_positions(positions, chunk))


def _fold_columns(x: jax.Array, op: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
  """``[m]``: ``op`` folded over the columns of ``x`` ``[m, w]``, pairwise (column ``i``
  with column ``i + w // 2``, an odd last column carried to the next round).

  Elementwise operations on slices, which XLA fuses into the kernels that read
  them, where ``jnp.sum`` and the like are reductions of their own (ResNet-50 on
  XLA:CPU, 25 MiB buckets: 310 to 303 kernels). A sum's order is this one on every
  backend, and :func:`jaxcomp._src.native.two_level` takes it too.
  """
  while x.shape[1] > 1:
    half = x.shape[1] // 2
    folded = op(x[:, :half], x[:, half:2 * half])
    x = jnp.concatenate([folded, x[:, 2 * half:]], axis=1) if x.shape[1] % 2 else folded
  return x[:, 0]


def _decoded(code: jax.Array, levels: jax.Array) -> jax.Array:
  """f32 entries of 2-bit ``code`` ``[..., chunks, k]`` with ``levels`` ``[..., chunks, 2]``."""
  magnitude = jnp.where((code >> 1) & 1 == 1, levels[..., 1:2], levels[..., 0:1])
  return jnp.where(code & 1 == 1, -magnitude, magnitude)


def decode(codes: jax.Array, levels: jax.Array, k: int) -> jax.Array:
  """The entries ``f32[..., chunks, k]`` of :func:`encode`'s ``codes`` and ``levels``."""
  shifts = jnp.array([0, 2, 4, 6], jnp.uint8)
  code = ((codes[..., None] >> shifts) & 3).reshape(codes.shape[:-1] + (-1,))[..., :k]
  return _decoded(code, levels)


def sparseloco(
    density: float,
    axis_name: checks.AxisName,
    *,
    chunk_size: int = 4096,
    error_decay: float = 0.95,
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """SparseLoCo: top-k in every chunk, each value in 2 bits, error feedback with decay.

  The fused gradient is cut into chunks of ``C`` entries (``chunk_size``,
  at most the gradient's size; the last one zero-padded). With ``e`` this
  device's residual, ``c = g + e``; per chunk the ``k = max(1, ceil(density
  C))`` entries of largest magnitude are sent as 2-bit codes (sign, and
  which of two magnitudes) with their uint16 positions and the chunk's two
  f32 magnitudes (:func:`encode`), in one all-gather; every device decodes
  every device's message and averages. What this device did not send stays
  behind, decayed: ``e' = error_decay * (c - s)``, ``s`` its decoded
  entries. This is SparseLoCo's outer step (Sarfi et al., arXiv:2508.15706),
  whose error feedback stands in for the outer momentum: use it as a DiLoCo
  outer compressor (:func:`jaxcomp.training.make_diloco_step`) with plain
  SGD after it, ``outer_optimizer=optax.sgd(1.0)``.

  Args:
    density: share of each chunk sent, in (0, 1] (the paper: 1-3%).
    axis_name: the mesh axis, or a pair of axes (one all-gather over both).
    chunk_size: entries per chunk, an int in ``[1, 65536]`` (positions are
      uint16).
    error_decay: ``beta`` in ``e' = beta (c - s)``, in [0, 1].
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf) (:func:`jaxcomp.protocol.plan`); each bucket is
      chunked on its own.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`SparseLoCoState`,
    whose ``update`` returns the mean, identical on every device, in the
    dtype of ``updates``.

  Wire: one all-gather of ``M = chunks (ceil(k / 4) + 2 k + 8)`` bytes from
  each device, ``(P - 1) M`` bytes per device (:func:`message_bytes`): at
  ``density`` 1/64 with ``C = 4096`` about ``0.13`` bytes per entry, against
  the dense all-reduce's ``8 (P - 1) / P``.
  """
  density, chunk_size, error_decay, bucket_cap_mb = checks.check_chunked(
      density, chunk_size, MAX_CHUNK, error_decay, bucket_cap_mb)
  axes = checks.check_axis_name(axis_name)

  def step(ctx, corrected, state):
    del state
    n = ctx.bucket.size
    chunk, chunks, k = selection.chunks(n, chunk_size, density)
    # ``corrected`` comes padded to whole chunks (``flat_length``).
    codes, positions, levels, values, flat = encoded(corrected, chunk, k)
    # Codes and positions as bytes, beside the magnitudes as they go on the
    # wire (divided by P, NaN when this device's gradient is not finite).
    gathered = ctx.allgather(  # [P, chunks, bytes]
        [codes, lax.bitcast_convert_type(positions, jnp.uint8).reshape(chunks, -1),
         lax.bitcast_convert_type(ctx.send(levels), jnp.uint8).reshape(chunks, -1)])
    code_bytes = -(-k // 4)
    all_codes = gathered[..., :code_bytes]
    all_positions = lax.bitcast_convert_type(
        gathered[..., code_bytes:code_bytes + _INDEX_BYTES * k].reshape(
            gathered.shape[:2] + (k, _INDEX_BYTES)), jnp.uint16)
    all_levels = lax.bitcast_convert_type(
        gathered[..., code_bytes + _INDEX_BYTES * k:].reshape(gathered.shape[:2] + (2, 4)),
        jnp.float32)
    mean = protocol.Later(
        lambda after: collectives.densify(decode(all_codes, all_levels, k),
                                          selection.flat_positions(all_positions, chunk),
                                          chunks * chunk, after)[:n],
        received=gathered)

    def kept():
      return error_decay * corrected.at[flat].add(-values, mode="drop")[:n]

    return protocol.Output(mean=mean, residual=kept, witness=all_levels)

  def wire_cost(bucket, sizes, steps):
    del steps
    return wire.allgather(message_bytes(bucket.size, chunk_size, density), sizes)

  return protocol.compressor(protocol.Method(
      name="sparseloco",
      config=dict(density=density, axis_name=axis_name, chunk_size=chunk_size,
                  error_decay=error_decay, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=SparseLoCoState, step=step, wire=wire_cost, error_feedback=True,
      payload_carries_nonfinite=True, bucket_cap_mb=bucket_cap_mb,
      flat_length=selection.chunked_length(chunk_size, density)))
