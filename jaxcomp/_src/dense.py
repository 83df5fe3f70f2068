"""The uncompressed baselines: the dense mean in f32 (S-SGD) and in 16 bits.

``cast`` is the same dense all-reduce as ``allreduce`` with a narrower value on
the wire, so both are built by one factory here.
"""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
import optax

from jaxcomp._src import checks
from jaxcomp._src import protocol
from jaxcomp._src import wire


def _dense_mean(name: str, config: dict, axis_name: checks.AxisName, wire_dtype,
                bucket_cap_mb: Optional[float]):
  axes = checks.check_axis_name(axis_name)
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)

  def step(ctx, corrected, state):
    del state
    return protocol.Output(mean=ctx.mean(corrected, wire_dtype=wire_dtype))

  def wire_cost(bucket, sizes, steps):
    del steps
    return wire.mean(bucket.size, sizes, wire_dtype=wire_dtype)

  return protocol.compressor(protocol.Method(
      name=name, config={**config, "axis_name": axis_name, "bucket_cap_mb": bucket_cap_mb},
      axes=axes, state=optax.EmptyState, step=step, wire=wire_cost, propagates_nonfinite=True,
      bucket_cap_mb=bucket_cap_mb))


def allreduce(
    axis_name: checks.AxisName, *, bucket_cap_mb: Optional[float] = None
) -> optax.GradientTransformation:
  """The dense mean of the gradients over the device axis: synchronous SGD.

  Every leaf is fused into one f32 buffer and averaged with one all-reduce (a
  ring ``psum``), or with the 2D-torus all-reduce when ``axis_name`` is a pair
  ``(row_axis, col_axis)``. This is the baseline every compressor is compared
  with.

  Args:
    axis_name: the data-parallel mesh axis, or a pair of axes for the torus.
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket's mean is
      the dense mean of its entries, as without buckets.

  Returns:
    An ``optax.GradientTransformation``
    whose ``update`` returns the mean gradient, identical on every device, in
    the dtype of ``updates``. Its state is empty.

  Wire: ring all-reduce, ``2 (P - 1) / P * 4 n`` bytes per device for ``n``
  gradient elements; on an ``R x C`` torus, ``(R - 1) / R * 4 n`` twice (the
  reduce-scatter and the all-gather) plus ``2 (C - 1) / C * 4 n / R``. With
  buckets, the formula of each bucket's ``n``.

  Example::

    tx = optax.chain(jaxcomp.allreduce("data"), optax.sgd(0.1, momentum=0.9))
  """
  return _dense_mean("allreduce", {}, axis_name, None, bucket_cap_mb)


def cast(
    dtype: Any, axis_name: checks.AxisName, *, bucket_cap_mb: Optional[float] = None
) -> optax.GradientTransformation:
  """The dense mean with 16-bit values on the wire (fp16 or bf16).

  The f32 gradient buffer is rounded to ``dtype`` and averaged as a
  reduce-scatter (an all-to-all of the bit-cast 16-bit chunks, summed locally
  in f32), then an all-gather of the bit-cast 16-bit mean. Sending the bits as
  unsigned integers keeps the payload 16-bit on every backend: XLA's CPU
  backend widens a bf16 all-reduce to f32, which would send as much as dense.
  fp16 overflows above 65504: such a step returns ``inf`` and is skipped by
  ``optax.apply_if_finite`` like any non-finite step.

  Args:
    dtype: the wire dtype, ``jnp.float16`` or ``jnp.bfloat16`` (``jnp.float32``
      is accepted and is the same as :func:`allreduce`).
    axis_name: the data-parallel mesh axis, or a pair of axes for the torus.
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket is
      padded to a multiple of ``P`` on its own.

  Returns:
    An ``optax.GradientTransformation`` with an empty state.

  Wire: ``2 (P - 1) / P * 2 n`` bytes per device (``n`` padded to a multiple
  of P): ``(P - 1) / P * 2 n`` in the all-to-all and as much in the all-gather.

  Example::

    tx = optax.chain(jaxcomp.cast(jnp.bfloat16, "data"), optax.adamw(3e-4))
  """
  try:
    wire_type = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"`dtype` must be a floating dtype, got {dtype!r}") from e
  if not jnp.issubdtype(wire_type, jnp.floating) or wire_type.itemsize not in (2, 4):
    raise TypeError(
        "`dtype` must be a 16- or 32-bit floating dtype (float16, bfloat16,"
        f" float32), got {wire_type}"
    )
  return _dense_mean("cast", {"dtype": wire_type.name}, axis_name,
                     None if wire_type.itemsize == 4 else wire_type, bucket_cap_mb)
