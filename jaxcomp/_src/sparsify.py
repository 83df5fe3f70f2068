"""Sparsifiers: top-k, global top-k and random-k.

Each fuses the whole gradient into one flat f32 bucket (the shared path of
:mod:`jaxcomp.protocol`), selects ``k = max(1, ceil(density * n))`` of its
``n`` coordinates once, and communicates a fixed-capacity ``(values,
indices)`` payload, so shapes are static and one compile serves every step.
What is not sent stays in the residual (error feedback, on the shared path).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import checks
from jaxcomp._src import collectives
from jaxcomp._src import draws
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import wire

# ------------------------------------------------------------------ states


class TopKState(NamedTuple):
  """State of :func:`topk`.

  Attributes:
    count: int32 scalar, steps taken (saturating).
    residual: ``f32[n]``, the gradient's leaves fused in tree order (a
      tuple of one per bucket with ``bucket_cap_mb``), this device's error
      feedback; ``()`` when ``error_feedback=False``.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]


class GTopKState(NamedTuple):
  """State of :func:`gtopk`.

  Attributes:
    count: int32 scalar, steps taken (saturating).
    residual: ``f32[n]``, the gradient's leaves fused in tree order (a
      tuple of one per bucket with ``bucket_cap_mb``), this device's error
      feedback (it differs per device).
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]


class RandomKState(NamedTuple):
  """State of :func:`randomk`.

  Attributes:
    count: int32 scalar, steps taken (saturating).
    residual: ``f32[n]``, the gradient's leaves fused in tree order (a
      tuple of one per bucket with ``bucket_cap_mb``), this device's error
      feedback (it differs per device).
    rng_key: uint32 raw key data, split every step; the same on every device.
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]
  rng_key: jax.Array


# ------------------------------------------------------------------ topk


def topk(
    density: float,
    axis_name: checks.AxisName,
    *,
    error_feedback: bool = True,
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """Top-k sparsification with a sparse all-gather.

  The gradient is fused into one f32 bucket of ``n`` elements and corrected
  with this device's residual, ``c = g + e``. The ``k = max(1, ceil(density
  * n))`` entries of largest ``|c|`` are selected locally (exactly those of
  ``lax.top_k``; :func:`jaxcomp.selection.topk` picks the route per backend),
  every device's ``(values / P, indices)`` is all-gathered, and the mean is
  the scatter-add of the ``P * k`` entries. With error feedback
  the new residual is ``e' = c - s``, ``s`` this device's selected entries
  (``s + e' == c`` bit for bit).

  Args:
    density: share of the gradient each device sends, in (0, 1].
    axis_name: the data-parallel mesh axis, or a pair of axes (one all-gather
      over both).
    error_feedback: keep what was not sent in a per-device residual.
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); ``k`` is then
      ``max(1, ceil(density * n_b))`` of each bucket's ``n_b`` elements (a
      bucket large enough for the exact search on CPU, where that search
      runs in JAX and not as the native custom call, is selected in a
      buffer zero-padded to a multiple of a 16th of the cap
      (:func:`jaxcomp.selection.shared_length`), so that
      buckets of about one size compile one selection).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`TopKState`, whose
    ``update`` returns the mean gradient, identical on every device, in the
    dtype of ``updates``.

  Wire: two all-gathers (f32 values and int32 indices) of ``k`` each,
  ``(P - 1) * 8 k`` bytes per device per step (per bucket, with its ``k``).

  Example::

    tx = optax.chain(jaxcomp.topk(0.01, "data"), optax.sgd(0.1))

  References:
    Aji & Heafield, `Sparse Communication for Distributed Gradient Descent
    <https://arxiv.org/abs/1704.05021>`_, EMNLP 2017; Shi et al.,
    `Understanding Top-k Sparsification in Distributed Deep Learning
    <https://arxiv.org/abs/1911.08772>`_, 2019.
  """
  density = checks.check_density(density)
  axes = checks.check_axis_name(axis_name)
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)
  use_residual = checks.check_bool(error_feedback, "error_feedback")

  def step(ctx, corrected, state):
    del state
    values, indices = _select(corrected, density, ctx.bucket.size)
    all_values, all_indices = ctx.sparse_allgather(values, indices)
    return protocol.Output(
        mean=protocol.Later.densified(all_values, all_indices, ctx.bucket,
                                      received=all_indices),
        residual=protocol.Zeroed(indices),
        witness=all_values)

  def wire_cost(bucket, sizes, steps):
    del steps
    return wire.sparse_allgather(checks.num_selected(density, bucket.size), sizes)

  return protocol.compressor(protocol.Method(
      name="topk", config=dict(density=density, axis_name=axis_name,
                               error_feedback=use_residual, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=TopKState, step=step, wire=wire_cost,
      error_feedback=use_residual, payload_carries_nonfinite=True,
      bucket_cap_mb=bucket_cap_mb, flat_length=_shared_length(bucket_cap_mb)))


# ------------------------------------------------------------------ gtopk


def gtopk(
    density: float, axis_name: checks.AxisName, *, bucket_cap_mb: Optional[float] = None
) -> optax.GradientTransformation:
  """Global top-k (gTop-k) sparsification with the butterfly all-reduce.

  Each device corrects its fused gradient with its residual, ``c = g + e``,
  and selects its local top-k. :func:`jaxcomp.collectives.gtopk_allreduce`
  then merges the k-sparse vectors pairwise over ``log2(P)`` rounds, keeping
  the ``k`` largest magnitudes of each sum, so every device ends with the
  same global top-k of the summed sparse vectors (each device's values
  divided by ``P`` before the butterfly); the mean is that vector densified. Residual put-back, as in the paper: an
  entry this device selected whose index is not in the global set stays in
  its residual, ``e' = c - s`` with ``s`` this device's selected entries at
  the global indices. (An index can reach the global set through some
  devices' partial sums only; each device still counts its entry as sent, as
  the paper does, so the sum of the residuals tracks the mean's mass only
  approximately.)

  Args:
    density: share of the gradient kept globally, in (0, 1].
    axis_name: the data-parallel mesh axis, or a pair of axes (the butterfly
      runs over both, in linear device order).
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket keeps
      its own global ``k = max(1, ceil(density * n_b))``, its local top-k
      selected as :func:`topk`'s.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`GTopKState`.

  Wire: ``log2(P)`` collective-permutes of ``k`` f32 values and ``k`` int32
  indices, ``log2(P) * 8 k`` bytes per device for power-of-two P; other P
  add two rounds (fold and send-back) for the devices past the largest power
  of two. With buckets, the formula of each bucket's ``k``.

  Example::

    tx = optax.chain(jaxcomp.gtopk(1e-3, "data"), optax.sgd(0.1))

  References:
    Shi et al., `A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification for Low Bandwidth Networks
    <https://arxiv.org/abs/1901.04359>`_, ICDCS 2019.
  """
  density = checks.check_density(density)
  axes = checks.check_axis_name(axis_name)
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)

  def step(ctx, corrected, state):
    del state
    k = checks.num_selected(density, ctx.bucket.size)
    values, indices = _select(corrected, density, ctx.bucket.size)
    global_values, global_indices = ctx.gtopk(values, indices, k)
    # Put-back: membership by one sort of both index sets (2k entries), not an
    # n-sized mask: a local index is in the global set where it follows its
    # equal from the global set (``origin`` -1; a local entry's own slot else).
    both = jnp.concatenate([global_indices, indices])
    origin = jnp.concatenate([jnp.full(k, -1, jnp.int32), jnp.arange(k, dtype=jnp.int32)])
    both, origin = lax.sort((both, origin), num_keys=2)
    member = (origin[1:] >= 0) & (both[1:] == both[:-1]) & (origin[:-1] < 0)
    slot = jnp.where(member, origin[1:], k)
    in_global = jnp.zeros(k, bool).at[slot].set(True, mode="drop")
    sent = jnp.where(in_global, indices, collectives.EMPTY_INDEX)
    return protocol.Output(
        mean=protocol.Later.densified(global_values, global_indices, ctx.bucket,
                                      received=global_indices),
        residual=protocol.Zeroed(sent),
        witness=global_values)

  def wire_cost(bucket, sizes, steps):
    del steps
    return wire.gtopk(checks.num_selected(density, bucket.size), sizes)

  return protocol.compressor(protocol.Method(
      name="gtopk", config=dict(density=density, axis_name=axis_name,
                                bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=GTopKState, step=step, wire=wire_cost, error_feedback=True,
      payload_carries_nonfinite=True, bucket_cap_mb=bucket_cap_mb,
      flat_length=_shared_length(bucket_cap_mb)))


# Buckets are padded to a multiple of this share of the cap (_shared_length).
_CAP_SHARE = 16


def _shared_length(bucket_cap_mb: Optional[float]) -> Optional[Callable]:
  """topk's and gtopk's ``flat_length``: with buckets, each bucket zero-padded to a
  multiple of a 16th of the cap where the selection takes its exact route in JAX
  (:func:`jaxcomp._src.selection.shared_length`), so that buckets of about the
  cap's size select in one compiled shape; ``None`` (no padding) without."""
  if bucket_cap_mb is None:
    return None
  granule = max(1, int(bucket_cap_mb * (1 << 20)) // 4 // _CAP_SHARE)
  return lambda bucket, num_devices: selection.shared_length(bucket.size, granule)


def _select(corrected: jax.Array, density: float, size: int) -> tuple[jax.Array, jax.Array]:
  """The top ``k = max(1, ceil(density * size))`` of ``corrected[:size]``, ``corrected``
  zero-padded to a shared length: selected in the capacity of that length (one shape
  for every bucket of that length), then cut to ``k`` (values, int32 indices)."""
  k = checks.num_selected(density, size)
  capacity = checks.num_selected(density, corrected.shape[0])
  values, indices = selection.topk(corrected, capacity, k=k)
  return values[:k], indices[:k]


# ------------------------------------------------------------------ randomk


def random_indices(key: jax.Array, n: int, k: int) -> jax.Array:
  """``k`` distinct indices of ``[0, n)``, sorted (int32), each drawn with probability ``k / n``.

  A stratified draw with a random rotation, ``O(k)`` work: ``[0, n)`` is cut
  into ``k`` strata of ``q = n // k`` consecutive positions, ``q + 1`` for
  the first ``n % k`` (stratum ``j`` starts at ``j q + min(j, n % k)``); one
  position is drawn uniformly in each, and all are rotated by one uniform
  ``r``, from ``k + 1`` counter-based draws (:func:`jaxcomp._src.draws.bits`,
  no threefry loop)::

    u = draws.bits(key, k + 1)
    r = u[k] mod n
    index_j = (start_j + u[j] mod size_j + r) mod n

  The rotation makes the inclusion probability of every position ``k / n``
  (it falls in each position of the strata equally often; the modulo
  favours low values by at most ``n / 2**32``, relative), as in
  a uniform ``k``-subset, which would cost a draw and a selection over all
  ``n``; the strata make the indices distinct and spread out (never two in
  one stratum). All of ``[0, n)``, in order, when ``k == n``.

  Args:
    key: a typed PRNG key; the same key gives the same indices on every device.
    n: the number of positions, ``>= 1``.
    k: how many to draw, ``1 <= k <= n``.

  Returns:
    ``int32[k]``, increasing.
  """
  if k == n:
    return jnp.arange(n, dtype=jnp.int32)
  rotation = (draws.bits_at(key, k) % jnp.uint32(n)).astype(jnp.int32)
  return _rotated_strata(lambda stratum: draws.bits_at(key, stratum), rotation, n, k)


def _rotated_strata(draw: Callable[[jax.Array], jax.Array], rotation: jax.Array, n: int,
                    k: int) -> jax.Array:
  """:func:`random_indices` from ``draw`` (int32 strata to their uint32 draws) and ``r``.

  Every entry is computed where it lands, in one elementwise pass over ``k``
  (no sum over the strata and no roll, each a kernel of its own per bucket):
  positions at or above ``t = n - r`` wrap to the front, and they are the
  strata after the one holding ``t``, and that one if its position is at or
  above ``t``; so that count is known from ``t`` and one stratum's draw.
  """
  q, longer = divmod(n, k)

  def position(stratum):
    start = stratum * q + jnp.minimum(stratum, longer)
    size = q + (stratum < longer).astype(jnp.int32)
    return start + (draw(stratum) % size.astype(jnp.uint32)).astype(jnp.int32)

  threshold = n - rotation  # in [1, n]; position + r may pass 2**31, position - t may not
  # The stratum holding t, k when t == n. Truncating divisions of non-negative ints: a
  # floor division is three kernels of its own on scalars.
  holder = lax.div(threshold, jnp.int32(q))
  if longer:
    longer_end = longer * (q + 1)
    holder = jnp.where(threshold < longer_end, lax.div(threshold, jnp.int32(q + 1)),
                       longer + lax.div(jnp.maximum(threshold - longer_end, 0), jnp.int32(q)))
  held = position(jnp.minimum(holder, k - 1)) >= threshold
  wrapped = jnp.where(holder < k, k - 1 - holder + held.astype(jnp.int32), 0)
  slot = lax.iota(jnp.int32, k)
  stratum = jnp.where(slot >= wrapped, slot - wrapped, slot - wrapped + k)
  shifted = position(stratum) - threshold
  return jnp.where(shifted >= 0, shifted, shifted + n)


def randomk(
    density: float,
    axis_name: checks.AxisName,
    seed: int = 0,
    *,
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """Random-k sparsification: shared random coordinates, one dense all-reduce.

  Every step draws ``k = max(1, ceil(density * n))`` distinct coordinates of
  the fused gradient from the PRNG key in the state, one in each of ``k``
  equal strata under a random rotation (:func:`random_indices`: each
  coordinate is sent with probability ``k / n``, and the draw is ``O(k)``
  work, no pass over ``n``). The key is the same on every device (it is
  never folded with ``axis_index``) and is split every step, so all devices
  pick the same coordinates and their ``k`` values are averaged with one
  dense all-reduce (the 2D-torus all-reduce for a pair of axes). Error
  feedback keeps the rest: ``e' = c - s``, ``c = g + e``, ``s`` the values
  taken.

  Args:
    density: share of the gradient sent, in (0, 1].
    axis_name: the data-parallel mesh axis, or a pair of axes (torus).
    seed: the PRNG seed of the coordinates, an int in ``[0, 2**32)``; it must
      be the same on every device (it is, when ``init`` runs once).
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket draws
      its own ``k = max(1, ceil(density * n_b))`` coordinates, from the step's
      key derived with the bucket's index (:func:`jaxcomp._src.draws.derive`).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`RandomKState`.

  Wire: one ring all-reduce of ``k`` f32 values, ``2 (P - 1) / P * 4 k``
  bytes per device (the torus formula of :func:`jaxcomp.allreduce` with
  ``k`` for ``n`` on a pair of axes); no indices travel. With buckets, the
  formula of each bucket's ``k``.

  Example::

    tx = optax.chain(jaxcomp.randomk(0.01, "data", seed=0), optax.sgd(0.1))

  References:
    Stich et al., `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, NeurIPS 2018.
  """
  density = checks.check_density(density)
  axes = checks.check_axis_name(axis_name)
  seed = checks.check_seed(seed)
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)

  def step(ctx, corrected, state):
    del state
    n = ctx.bucket.size
    indices = random_indices(ctx.key, n, checks.num_selected(density, n))
    mean_values = ctx.mean(corrected.at[indices].get(
        indices_are_sorted=True, unique_indices=True, mode="promise_in_bounds",
        wrap_negative_indices=False))
    return protocol.Output(
        mean=protocol.Later.densified(mean_values, indices, ctx.bucket, received=()),
        residual=protocol.Zeroed(indices),
        witness=mean_values)

  def wire_cost(bucket, sizes, steps):
    del steps
    return wire.mean(checks.num_selected(density, bucket.size), sizes)

  return protocol.compressor(protocol.Method(
      name="randomk", config=dict(density=density, axis_name=axis_name, seed=seed,
                                  bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=RandomKState, step=step, wire=wire_cost, error_feedback=True,
      seed=seed, bucket_cap_mb=bucket_cap_mb))
