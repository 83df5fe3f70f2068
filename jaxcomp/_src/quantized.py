"""Integer quantization: 8 or 4 bits per entry and one f32 scale per block, summed in f32."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import checks
from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import two_hop

BITS = (4, 8)


class QuantizedState(NamedTuple):
  """State of :func:`quantized`.

  Attributes:
    count: steps taken (int32, saturating).
    residual: with error feedback, ``f32[n]``, the gradient's leaves fused
      in tree order (a tuple of one per bucket with ``bucket_cap_mb``), this
      device's ``corrected - Q(corrected)``; without it, ``()``.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]


def encode(x: jax.Array, bits: int, block: int,
           scales: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """``(uint8 payload, f32 scales [m])`` of a flat ``x`` of ``m * block`` entries
  (``scales``: ``x``'s, where already known; only the payload is computed).

  Per block ``b``: the scale ``s_b = max |x_b| / q`` with ``q = 2**(bits - 1) - 1``
  (127 or 7), each entry rounded to the nearest integer of ``x_i / s_b`` (in
  ``[-q, q]``); 8 bits: one int8 per entry; 4 bits: two entries per byte,
  each as ``l + 8`` in a nibble (the first in the low one). A block holding a
  NaN or an infinity has the scale ``inf`` (NaN counted as ``inf``: XLA:CPU's
  vectorised ``max`` may drop a NaN), so it decodes to non-finite values.
  """
  level, scales = _levels(x, bits, block, scales)
  if bits == 8:
    return lax.bitcast_convert_type(level, jnp.uint8), scales
  nibbles = (level + 8).astype(jnp.uint8).reshape(-1, 2)
  return nibbles[:, 0] | (nibbles[:, 1] << 4), scales


def _levels(x: jax.Array, bits: int, block: int,
            scales: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """``(int8 levels [m * block], f32 scales [m])``: :func:`encode`'s before they are bytes."""
  blocks = x.reshape(-1, block)
  top = _top(bits)
  scales = selection.max_magnitude(blocks) / top if scales is None else scales
  level = jnp.round(blocks / jnp.where(scales == 0, 1.0, scales)[:, None])
  return jnp.clip(level, -top, top).astype(jnp.int8).reshape(-1), scales


def _top(bits: int) -> int:
  """The largest level of ``bits``-bit codes, ``2**(bits - 1) - 1``: a scale is a block's
  largest magnitude over it."""
  return 2 ** (bits - 1) - 1


def decode(payload: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
  """f32 ``[..., m * block]`` from :func:`encode`'s ``[..., L]`` payload and ``[..., m]`` scales."""
  if bits == 8:
    level = lax.bitcast_convert_type(payload, jnp.int8).astype(jnp.float32)
  else:
    low = (payload & 15).astype(jnp.float32) - 8
    high = (payload >> 4).astype(jnp.float32) - 8
    level = jnp.stack([low, high], axis=-1).reshape(payload.shape[:-1] + (-1,))
  return _scaled(level, scales)


def _scaled(level: jax.Array, scales: jax.Array) -> jax.Array:
  """f32 levels ``[..., m * block]`` times their blocks' scales ``[..., m]``."""
  steps = level.reshape(level.shape[:-1] + (scales.shape[-1], -1))
  return (scales[..., None] * steps).reshape(level.shape)


def _dequantized(x: jax.Array, scales: jax.Array, bits: int, block: int) -> jax.Array:
  """``decode(encode(x, scales))`` from the levels, not the bytes: the same values.

  Read from the bytes, each entry of 4-bit codes unpacks a byte that packs
  two levels, each computed again for it (on 8 devices the residual of
  ResNet-50's 4-bit step took 6x the 8-bit one's time).
  """
  return _scaled(_levels(x, bits, block, scales)[0].astype(jnp.float32), scales)


def _payload_bytes(bits: int):
  return lambda entries: entries * bits // 8


def _codec(bits: int, block: int) -> two_hop.Codec:
  return two_hop.Codec(lambda x, hop, scales=None: encode(x, bits, block, scales),
                       lambda payload, scales: decode(payload, scales, bits),
                       _payload_bytes(bits),
                       lambda x, scales: _dequantized(x, scales, bits, block))


def quantized(
    bits: int,
    axis_name: checks.AxisName,
    *,
    block_size: int = 64,
    error_feedback: bool = True,
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """A mean of 8- or 4-bit integers, each block with its own f32 scale, summed in f32.

  The fused gradient ``c`` (plus the residual with error feedback), padded
  to ``P`` equal chunks, is cut into blocks of ``B`` entries; each block is
  sent as its scale ``s_b = max |c_b| / q`` (f32, divided by ``P``) and each
  entry as the nearest integer of ``c_i / s_b``, ``q = 127`` for 8 bits and
  ``7`` for 4 (two entries in a byte). The mean is reduced as a quantized
  reduce-scatter and all-gather (:mod:`jaxcomp._src.two_hop`): an all-to-all
  brings chunk ``j`` of every device to device ``j``, which decodes and sums
  it in f32, encodes the chunk of the mean again, and an all-gather brings it
  to every device. Rounding is to the nearest, the same on every device;
  error feedback (the default) keeps what this device's own rounding
  dropped, ``c - Q(c)``. On CPU the first encoding and the residual are
  custom calls that read the leaves (and the residual) where they lie
  (:func:`jaxcomp._src.native.integer_encode`, the JAX route's bytes and
  scales; :func:`jaxcomp._src.native.integer_residual`, to a rounding of
  ``s l``, which XLA may fuse into one): ``c`` is never written.
  This is the quantized all-reduce of torchft's
  DiLoCo (FP8 rows there) and of INTELLECT-1's int8 pseudo-gradients, and
  Streaming DiLoCo's 4-bit outer gradients.

  Args:
    bits: 8 or 4.
    axis_name: the data-parallel mesh axis, or a pair of axes (both hops
      run over the whole mesh).
    block_size: entries per scale, an int >= 2 (at most a device's chunk,
      ``ceil(n / P)``, rounded up to an even number with 4 bits).
    error_feedback: keep ``c - Q(c)`` in a per-device residual.
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf
      order and exchanged one after the other (:func:`jaxcomp.protocol.plan`);
      each bucket is padded to ``P`` chunks and cut into blocks of its own.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`QuantizedState`,
    whose ``update`` returns the decoded mean, identical on every device, in
    the dtype of ``updates``.

  Wire: a chunk of ``C = ceil(n / (P B)) B`` entries is ``C bits / 8 + 4 C / B``
  bytes; the all-to-all and the all-gather each send ``P - 1`` chunks:
  ``2 (P - 1) (C bits / 8 + 4 C / B)`` bytes per device, about
  ``2 (P - 1) / P n (bits / 8 + 4 / B)``: for 8 bits and ``B = 64``, 0.27 of
  the dense f32 all-reduce's bytes; for 4 bits, 0.14.

  Example::

    tx = optax.chain(jaxcomp.quantized(8, "data"), optax.sgd(0.1, momentum=0.9))

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025 (4-bit outer gradients);
    Jaghouar et al., `INTELLECT-1 Technical Report
    <https://arxiv.org/abs/2412.01152>`_, 2024 (int8 all-reduce).
  """
  bits = checks.check_number(bits, "bits", integer=True, low=min(BITS), high=max(BITS))
  if bits not in BITS:
    raise ValueError(f"`bits` must be one of {list(BITS)}, got {bits!r}")
  axes = checks.check_axis_name(axis_name)
  block_size = checks.check_number(block_size, "block_size", integer=True, low=2)
  error_feedback = checks.check_bool(error_feedback, "error_feedback")
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)
  multiple = 2 if bits == 4 else 1

  def prepare_leaves(ctx, leaves, state):
    """Where the native custom calls sum the bucket, nothing is formed before the step:
    its first encoding reads the leaves (the carry) and the residual where they lie
    (:func:`jaxcomp._src.native.integer_encode`), and so does the residual once the step
    is kept (:func:`jaxcomp._src.native.integer_residual`)."""
    del ctx, state
    return None, leaves

  def step(ctx, corrected, state):
    block, chunk = two_hop.chunking(ctx.bucket.size, ctx.num_devices, block_size, multiple)
    codec = _codec(bits, block)
    leaves = ctx.carry
    if leaves is not None:
      first = native.integer_encode(leaves, state.residual if error_feedback else None,
                                    ctx.num_devices * chunk, block, bits)
      mean, _, scales = two_hop.mean(ctx, None, codec, block, chunk, encoded=first)
      residual = fusion.Rewrite(
          lambda old: native.integer_residual(old, first[1], leaves, block, bits))
      return protocol.Output(mean=mean, residual=residual, witness=scales)
    mean, residual, scales = two_hop.mean(ctx, corrected, codec, block, chunk)
    return protocol.Output(mean=mean, residual=residual, witness=scales)

  def wire_cost(bucket, sizes, steps):
    del steps
    return two_hop.wire_cost(_payload_bytes(bits), bucket.size, block_size, sizes, multiple)

  return protocol.compressor(protocol.Method(
      name="quantized",
      config=dict(bits=bits, axis_name=axis_name, block_size=block_size,
                  error_feedback=error_feedback, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=QuantizedState, step=step, wire=wire_cost,
      flat_length=two_hop.flat_length(block_size, multiple),
      error_feedback=error_feedback, prepare_leaves=prepare_leaves,
      payload_carries_nonfinite=True,
      bucket_cap_mb=bucket_cap_mb))
