"""QSGD (Alistarh et al.): stochastic quantization to ``s`` levels, int8 on the wire."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import binade
from jaxcomp._src import checks
from jaxcomp._src import draws
from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import two_hop


class QSGDState(NamedTuple):
  """State of :func:`qsgd`.

  Attributes:
    count: steps taken (int32, saturating).
    residual: with error feedback, ``f32[n]``, the gradient's leaves fused
      in tree order (a tuple of one per bucket with ``bucket_cap_mb``), this
      device's ``corrected - quantized``; without it, ``()``.
    rng_key: uint32 raw key data, split every step, the same on every device;
      each device draws its own streams of the step's key (``2 d + h`` for
      device ``d``, hop ``h``), so the rounding noise is independent across
      devices.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]
  rng_key: jax.Array


def _norms(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(norms, inverses)``: the L2 norm of each row, and :func:`_inverses` of them; where a
  row's squares overflow, every row is brought to its largest entry's unit binade first
  (:func:`jaxcomp._src.binade.unit_norm`, exact).

  This is the JAX route: five small kernels and a branch per hop and per
  gradient bucket, no more for the one test of the norms below. On the native
  route (:func:`_native_norms`) the custom call that takes the levels takes the
  norms too (:func:`jaxcomp._src.native.qsgd_encode`, its squares summed in an
  order of its own: the routes agree to rounding).

  The test is that the norms' sum is finite: it is exactly when each norm is,
  since a finite norm is below ``sqrt(3.4e38) = 1.8e19`` and fewer than
  ``2**31`` of them cannot add up past f32's largest. One sum of the ``m``
  norms is one small kernel, where a test of each norm followed by an ``all``
  is three (XLA:CPU cuts a long ``all`` into a tree of windows).

  A row holding a NaN or an infinity has a non-finite norm on either path
  (its squares' sum, or the sum of the scaled squares, is NaN or ``inf``
  whatever the ``max`` makes of a NaN), so it decodes to non-finite values;
  so does a row whose norm exceeds f32's largest (its entries above about
  ``3.4e38 / sqrt(bucket_size)``), which no f32 norm can carry. A division by
  the largest entry instead would not do: XLA may take it as a product with
  the reciprocal, flushed to zero above ``2**126``, and the norm came out 0.
  """
  plain = jnp.sqrt(jnp.sum(blocks * blocks, axis=1))

  def scaled():
    unit, norm = binade.unit_norm(blocks, axis=1)
    return norm / unit

  # A branch on GPU too: faster there than both routes (see jaxcomp._src.binade).
  norms = lax.cond(jnp.isfinite(jnp.sum(plain)), lambda: plain, scaled)
  return norms, _inverses(norms)


def _native_norms() -> bool:
  """Whether the norms come from the custom calls (the corrected gradient's, or
  :func:`jaxcomp._src.native.qsgd_encode`): where they are built and asked for
  (:func:`jaxcomp._src.selection.native_route`)."""
  return selection.native_route()


def _inverses(norms: jax.Array) -> jax.Array:
  """``1 / (d u)`` of each norm, ``d`` the norm (1 for 0) and ``u`` its
  :func:`jaxcomp._src.binade.unit_factor`: a block's entries, brought to the
  same binade (``|x| u``, exact), times it are their share of the norm. The
  reciprocal of ``d`` itself would flush to zero for a norm above ``2**126``;
  a division by ``d u`` XLA takes as this product anyway, in a kernel of its own."""
  divisor = _divisor(norms)
  return 1.0 / (divisor * binade.unit_factor(divisor))


def _divisor(norms: jax.Array) -> jax.Array:
  """What a block's entries are divided by: its norm, or 1 for a zero norm."""
  return jnp.where(norms == 0, 1.0, norms)


def quantize(x: jax.Array, levels: int, bucket_size: int, key: jax.Array, stream=0,
             norms: Union[None, jax.Array, tuple[jax.Array, jax.Array]] = None):
  """``(int8 levels [m * bucket_size], f32 norms [m])`` of a flat ``x``, padded with zeros.

  Per bucket ``b`` of ``bucket_size`` entries: ``l_i = floor(s |x_i| /
  ||x_b||)``, rounded up to ``l_i + 1`` with probability ``s |x_i| /
  ||x_b|| - l_i``, signed like ``x_i``: ``E[sign(x_i) l_i ||x_b|| / s] = x_i``.
  The draws are :func:`jaxcomp._src.draws.uniform` of ``key`` and ``stream``.
  On the native route (:func:`jaxcomp._src.selection.native_route`) the levels
  are one custom call on two threads (:func:`jaxcomp._src.native.qsgd_levels`,
  the same bits), where XLA:CPU's fusion of the draws and the rounding ran on
  one (ResNet-50, one device: the step 129-132 ms to 105-107, in paired runs);
  without ``norms``, the same call takes them too, each block's levels while it
  is in cache (:func:`jaxcomp._src.native.qsgd_encode`).
  ``norms``: ``x``'s, or ``(norms, inverses)`` as :func:`_norms` gives them,
  where already known (only the levels are computed).
  """
  n = x.shape[0]
  blocks = -(-n // bucket_size)
  padded = jnp.pad(x, (0, blocks * bucket_size - n)).reshape(blocks, bucket_size)
  if norms is None and _native_norms():
    level, norms, _ = native.qsgd_encode(padded, bucket_size, levels, draws.words(key, stream))
    return level, norms
  if norms is None:
    norms, inverses = _norms(padded)
  elif isinstance(norms, tuple):
    norms, inverses = norms
  else:
    inverses = _inverses(norms)
  if selection.native_route():
    level = native.qsgd_levels(padded.reshape(-1), norms, inverses, levels,
                               draws.words(key, stream))
    return level, norms
  # |x_i| / ||x_b|| first (levels * |x_i| overflows for |x_i| above f32's largest / s),
  # both brought to the norm's unit binade (exact), so that the inverse does not
  # underflow.
  unit = binade.unit_factor(_divisor(norms))[:, None]
  scaled = levels * ((jnp.abs(padded) * unit) * inverses[:, None])
  floor = jnp.floor(scaled)
  up = draws.uniform(key, padded.size, stream).reshape(padded.shape) < scaled - floor
  level = jnp.minimum(floor + up, levels) * jnp.sign(padded)
  return level.astype(jnp.int8).reshape(-1), norms


def _codec(levels: int, block: int, key, device) -> two_hop.Codec:
  """QSGD's blocks as bytes: int8 levels (one byte each), the norms as the scales.

  The rounding draws of hop ``h`` (0: this device's gradient, 1: its chunk
  of the mean) are ``key``'s stream ``2 device + h``."""

  def encode(x, hop, norms=None):
    level, norms = quantize(x, levels, block, key, 2 * device + hop, norms)
    return lax.bitcast_convert_type(level, jnp.uint8), norms

  def decode(payload, norms):
    level = lax.bitcast_convert_type(payload, jnp.int8).astype(jnp.float32)
    steps = level.reshape(level.shape[:-1] + (-1, block))
    return (norms[..., None] / levels * steps).reshape(level.shape)

  return two_hop.Codec(encode, decode, _payload_bytes,
                       lambda x, norms: decode(encode(x, 0, norms)[0], norms), draws=True)


def _payload_bytes(entries: int) -> int:
  """One int8 level per entry."""
  return entries


def qsgd(
    levels: int,
    axis_name: checks.AxisName,
    *,
    bucket_size: int = 512,
    error_feedback: bool = False,
    seed: int = 0,
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """QSGD: unbiased stochastic quantization to ``s`` levels, reduced in two quantized hops.

  The fused gradient ``c`` (plus the residual with error feedback), padded
  to ``P`` equal chunks, is cut into buckets of ``B`` entries; each bucket
  ``b`` is sent as its L2 norm ``||c_b||`` (f32, divided by ``P``) and, per
  entry, an int8 level ``sign(c_i) l_i`` with ``l_i`` in ``{0, ..., s}``:
  ``floor(s |c_i| / ||c_b||)``, rounded up with probability equal to the
  remainder, so that ``E[||c_b|| / s * sign(c_i) l_i] = c_i`` (unbiased; the
  variance falls with ``s`` and with smaller buckets). The mean is reduced as
  a quantized reduce-scatter and all-gather, so the bytes fall like a dense
  all-reduce's with the device count:

  1. all-to-all: chunk ``j`` of every device's quantized gradient goes to
     device ``j``, which decodes the ``P`` of them and sums them in f32;
  2. device ``j`` quantizes that chunk of the mean again (a fresh draw) and
     an all-gather brings every chunk to every device, decoded alike.

  The rounding draws differ per device and per hop (the step's key, stream
  ``2 d + h`` for device ``d`` and hop ``h``), so the noise averages out
  across devices. Error feedback keeps what this device's own quantization
  dropped, ``c - Q(c)``. On CPU the first encoding is one custom call that
  reads the leaves (and the residual) where they lie
  (:func:`jaxcomp._src.native.qsgd_encode_leaves`, the JAX route's levels and,
  to rounding, its norms), and so is the residual
  (:func:`jaxcomp._src.native.qsgd_residual`): ``c`` is never written.

  Args:
    levels: ``s``, the number of quantization levels, an int in [1, 127].
    axis_name: the data-parallel mesh axis, or a pair of axes (both hops
      run over the whole mesh).
    bucket_size: entries per norm, an int >= 1 (the paper's 512 by default;
      at most a device's chunk, ``ceil(n / P)``).
    error_feedback: keep ``c - Q(c)`` in a per-device residual.
    seed: PRNG seed of the rounding, an int in ``[0, 2**32)``.
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each gradient
      bucket is padded to ``P`` chunks and cut into norm blocks of its own
      (a norm block never spans two gradient buckets).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`QSGDState`, whose
    ``update`` returns the decoded mean, identical on every device, in the
    dtype of ``updates``.

  Wire: a chunk of ``C = ceil(n / (P B)) B`` entries is ``C + 4 C / B``
  bytes (int8 levels, f32 norms); the all-to-all and the all-gather each
  send ``(P - 1)`` chunks: ``2 (P - 1) (C + 4 C / B)`` bytes per device, about
  ``2 (P - 1) / P * n``: a quarter of the dense f32 all-reduce's bytes. With
  gradient buckets, the formula of each bucket's ``n``.

  Example::

    tx = optax.chain(jaxcomp.qsgd(8, "data"), optax.sgd(0.1, momentum=0.9))

  References:
    Alistarh et al., `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, NeurIPS
    2017; Xu et al., `GRACE: A Compressed Communication Framework for
    Distributed Machine Learning <https://doi.org/10.1109/ICDCS51616.2021.00060>`_,
    ICDCS 2021.
  """
  levels = checks.check_number(levels, "levels", integer=True, low=1, high=127)
  axes = checks.check_axis_name(axis_name)
  bucket_size = checks.check_number(bucket_size, "bucket_size", integer=True, low=1)
  error_feedback = checks.check_bool(error_feedback, "error_feedback")
  seed = checks.check_seed(seed)
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)

  def prepare_leaves(ctx, leaves, state):
    """Where the native custom calls sum the bucket, nothing is formed before the step:
    its first encoding reads the leaves (the carry) and the residual where they lie
    (:func:`jaxcomp._src.native.qsgd_encode_leaves`, which takes the norms too: only
    where :func:`_native_norms` holds), and so does the residual once the step is kept
    (:func:`jaxcomp._src.native.qsgd_residual`)."""
    del ctx, state
    return (None, leaves) if _native_norms() else None

  def step(ctx, corrected, state):
    block, chunk = two_hop.chunking(ctx.bucket.size, ctx.num_devices, bucket_size)
    device = lax.axis_index(axes[0] if len(axes) == 1 else axes)
    codec = _codec(levels, block, ctx.key, device)
    leaves = ctx.carry
    if leaves is not None:
      level, norms, _ = native.qsgd_encode_leaves(
          leaves, state.residual if error_feedback else None, ctx.num_devices * chunk, block,
          levels, draws.words(ctx.key, 2 * device))
      mean, _, scales = two_hop.mean(
          ctx, None, codec, block, chunk,
          encoded=(lax.bitcast_convert_type(level, jnp.uint8), norms))
      # Each block's step as decode takes it: the norm over the levels.
      residual = fusion.Rewrite(lambda old: native.qsgd_residual(
          old, level, norms / levels, leaves, block))
      return protocol.Output(mean=mean, residual=residual, witness=scales)
    mean, residual, scales = two_hop.mean(ctx, corrected, codec, block, chunk)
    return protocol.Output(mean=mean, residual=residual, witness=scales)

  def wire_cost(bucket, sizes, steps):
    del steps
    return two_hop.wire_cost(_payload_bytes, bucket.size, bucket_size, sizes)

  return protocol.compressor(protocol.Method(
      name="qsgd",
      config=dict(levels=levels, axis_name=axis_name, bucket_size=bucket_size,
                  error_feedback=error_feedback, seed=seed, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=QSGDState, step=step, wire=wire_cost,
      flat_length=two_hop.flat_length(bucket_size),
      error_feedback=error_feedback, seed=seed,
      prepare_leaves=prepare_leaves, payload_carries_nonfinite=True,
      bucket_cap_mb=bucket_cap_mb))
