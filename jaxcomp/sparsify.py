"""Sparsifiers: top-k, global top-k and random-k, and the local selection they share.

Each compressor fuses the whole gradient pytree into one flat f32 bucket
(:class:`jaxcomp.fusion.Bucket`), selects ``k = max(1, ceil(density * n))``
coordinates of it once, and communicates a fixed-capacity ``(values,
indices)`` payload, so shapes are static and one compile serves every step.
Error feedback (:mod:`jaxcomp.error_feedback`, imported here as
``error_feedback_lib`` since ``topk`` has a keyword of that name) keeps what
was not sent.

The local selections live here too: :func:`select_topk` (exact, ``lax.top_k``),
:func:`exact_topk` (the same entries by a sampled threshold with an exact
fallback, what the sparsifiers use on large buckets) and :func:`sampled_topk`
(Deep Gradient Compression's sampled threshold, used by :func:`jaxcomp.dgc`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from jaxcomp import base
from jaxcomp import collectives
from jaxcomp import error_feedback as error_feedback_lib
from jaxcomp import fusion

# ------------------------------------------------------------ local selection

# The sampled threshold aims at this many times k, so that the count above it
# rarely falls short of k (its relative spread is about 1/sqrt(k * sample_ratio)).
# The sampled path pays off on large buckets: measured 4x faster than
# lax.top_k at 1M entries, 9-10x at 25.6M, slower at 100k (see
# experiments/bench_selection.py).
OVERSAMPLE = 1.25
# Candidates above the threshold are compacted into a buffer of this many
# times the capacity; more than that falls back to the exact top-k.
CANDIDATE_FACTOR = 2
# Fewer candidates than this fraction of k also falls back to the exact top-k.
MIN_FRACTION = 0.8

_WORD = 32  # mask bits packed per word by the compaction
# The sample is read in runs of this many consecutive entries (cache lines,
# not scattered words): one run at a random offset in each equal stratum.
_RUN = 32
# Radix passes for the sampled threshold: the 8 exponent and 8 highest
# mantissa bits (the estimate is rounded down by less than 0.4%, so slightly
# more is kept).
_SAMPLE_BITS = 16
# Buckets from this many entries on select with exact_topk, smaller ones with
# lax.top_k directly: at density 0.001 on CPU, exact_topk takes 1.8x the
# time of lax.top_k at 1M entries, half at 4M, a sixth at 25.6M.
EXACT_FAST_MIN = 1 << 22
# exact_topk samples this share of the bucket for its threshold (DGC's
# default), more when that would put fewer than _EXACT_SAMPLE_ABOVE sampled
# entries above it (a noisy threshold falls back more often), up to
# _EXACT_SAMPLE_MAX.
EXACT_SAMPLE_RATIO = 0.01
_EXACT_SAMPLE_ABOVE = 256
_EXACT_SAMPLE_MAX = 0.25


def _mask_tail(values, indices, k):
  """Slots ``k`` and beyond emptied (value 0, index ``EMPTY_INDEX``)."""
  keep = jnp.arange(values.shape[0]) < k
  return (
      jnp.where(keep, values, jnp.zeros((), values.dtype)),
      jnp.where(keep, indices, collectives.EMPTY_INDEX).astype(jnp.int32),
  )


def select_topk(x: jax.Array, capacity: int, k=None) -> tuple[jax.Array, jax.Array]:
  """The ``capacity`` largest magnitudes of a flat ``x`` (exact, ``lax.top_k``).

  Args:
    x: ``f32[n]``.
    capacity: static payload size, ``1 <= capacity <= n``.
    k: optional traced count ``<= capacity``; slots from ``k`` on are emptied.

  Returns:
    ``(values [capacity], int32 indices [capacity])``, largest magnitude first;
    empty slots hold value 0 and index ``collectives.EMPTY_INDEX``.
  """
  _, indices = lax.top_k(jnp.abs(x), capacity)
  values = x[indices]
  indices = indices.astype(jnp.int32)
  if k is None:
    return values, indices
  return _mask_tail(values, indices, k)


def _magnitude_bits(x: jax.Array) -> jax.Array:
  """``|x|`` as int32 bits: ordered like the magnitudes (NaN above ``inf``)."""
  return lax.bitcast_convert_type(jnp.abs(x), jnp.int32)


def _kth_largest_bits(bits: jax.Array, k, passes: int = 31) -> jax.Array:
  """The ``k``-th largest of non-negative int32 ``bits`` (entries < 0 ignored).

  A radix search from the high bit down: one compare-and-count pass per bit,
  no sort. With all 31 passes the answer ``t`` is the largest value with at
  least ``k`` entries ``>= t`` (0 when fewer than ``k`` entries are valid);
  fewer passes round it down to a multiple of ``2**(31 - passes)``.
  """
  def body(i, t):
    candidate = t | (jnp.int32(1) << (30 - i))
    return jnp.where(jnp.sum(bits >= candidate) >= k, candidate, t)

  return lax.fori_loop(0, passes, body, jnp.int32(0))


def _select_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
  """Position of the ``rank``-th (0-based) set bit of each uint32 ``word``."""
  pos = jnp.zeros(word.shape, jnp.uint32)
  rank = rank.astype(jnp.uint32)
  for width in (16, 8, 4, 2, 1):
    low = (word >> pos) & jnp.uint32((1 << width) - 1)
    count = lax.population_count(low)
    upper = rank >= count
    pos = jnp.where(upper, pos + width, pos)
    rank = jnp.where(upper, rank - count, rank)
  return pos.astype(jnp.int32)


def _pack(x: jax.Array, threshold: jax.Array, valid=None) -> jax.Array:
  """``uint32[len(x) / 32]``: bit ``j`` of word ``w`` is ``|x[32 w + j]| >= threshold``."""
  mask = _magnitude_bits(x) >= threshold
  if valid is not None:
    mask = mask & valid
  shifted = mask.reshape(-1, _WORD).astype(jnp.uint32) << jnp.arange(_WORD, dtype=jnp.uint32)
  return jnp.sum(shifted, axis=1, dtype=jnp.uint32)


def _compact(x: jax.Array, threshold: jax.Array, capacity: int):
  """Indices of the entries with magnitude bits ``>= threshold``, the first ``capacity``.

  One pass packs the mask into 32-bit words; a scan of the per-word counts
  (``n / 32`` of them) gives each word's first slot; each output slot then
  finds its word by binary search and its bit by a popcount search. No
  ``n``-sized cumsum, scatter or copy.

  Returns:
    ``(int32 indices [capacity] in increasing order, EMPTY_INDEX past the
    count; the count of entries above the threshold)``.
  """
  n = x.shape[0]
  full = n // _WORD
  parts = [_pack(x[:full * _WORD], threshold)] if full else []
  tail = n - full * _WORD
  if tail:
    padded = jnp.pad(x[full * _WORD:], (0, _WORD - tail))
    parts.append(_pack(padded, threshold, jnp.arange(_WORD) < tail))
  words = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
  counts = lax.population_count(words).astype(jnp.int32)
  ends = lax.associative_scan(jnp.add, counts)
  total = ends[-1]
  slots = jnp.arange(capacity, dtype=jnp.int32)
  word = jnp.minimum(jnp.searchsorted(ends, slots, side="right"), words.shape[0] - 1)
  rank = slots - (ends[word] - counts[word])
  index = word * _WORD + _select_bit(words[word], rank)
  return jnp.where(slots < total, index, collectives.EMPTY_INDEX), total


def sample_size(n: int, sample_ratio: float) -> int:
  """Static size of the sample of :func:`sampled_topk`: ``ceil(sample_ratio * n)``."""
  return max(1, math.ceil(sample_ratio * n))


def candidate_capacity(n: int, capacity: int) -> int:
  """Static size of the candidate buffer of :func:`sampled_topk`."""
  return min(n, CANDIDATE_FACTOR * capacity)


def threshold_candidates(
    x: jax.Array, k, key: jax.Array, sample_ratio: float, candidates: int
) -> tuple[jax.Array, jax.Array]:
  """Steps 1 and 2 of :func:`sampled_topk`: the entries above the sampled threshold.

  Returns:
    ``(int32 indices [candidates], increasing, EMPTY_INDEX past the count;
    the count of entries at or above the threshold)``.
  """
  n = x.shape[0]
  size = sample_size(n, sample_ratio)
  runs = -(-size // _RUN)
  stride = n // runs
  if stride >= _RUN:
    starts = jnp.arange(runs) * stride + jax.random.randint(key, (runs,), 0, stride - _RUN + 1)
    positions = (starts[:, None] + jnp.arange(_RUN)).reshape(-1)[:size]
  else:
    positions = jax.random.randint(key, (size,), 0, n)
  target = jnp.ceil(OVERSAMPLE * jnp.asarray(k, jnp.float32) * (size / n))
  target = jnp.clip(target, 1, size).astype(jnp.int32)
  threshold = _kth_largest_bits(_magnitude_bits(x[positions]), target, _SAMPLE_BITS)
  return _compact(x, threshold, candidates)


def sampled_topk(
    x: jax.Array, capacity: int, k, key: jax.Array, sample_ratio: float
) -> tuple[jax.Array, jax.Array]:
  """About the ``k`` largest magnitudes of ``x``, by a sampled threshold (DGC).

  1. Sample ``s = ceil(sample_ratio * n)`` entries: ``x`` is cut into
     ``ceil(s / 32)`` equal strata and ``key`` draws one run of 32
     consecutive entries at a uniform offset in each (a stratified cluster
     sample, read in increasing order, so memory traffic stays about ``4 s``
     bytes; with strata shorter than a run, ``s`` uniform positions). The
     threshold ``t`` is the ``ceil(OVERSAMPLE * k * s / n)``-th largest
     magnitude of the sample (a radix search, no sort).
  2. Count and compact the entries ``|x| >= t`` into a candidate buffer of
     ``CANDIDATE_FACTOR * capacity`` (:func:`_compact`: one pass over ``x``).
  3. If the count is within ``[MIN_FRACTION * k, CANDIDATE_FACTOR *
     capacity]``, keep the ``k`` largest candidates (exact among them, so the
     result is the exact top-k whenever the count reaches ``k``; between
     ``MIN_FRACTION * k`` and ``k`` every candidate is sent). Otherwise fall
     back to the exact ``lax.top_k`` of ``x``. The choice is a ``lax.cond``
     with no collective inside, so devices may take different branches.

  A capacity of ``n`` (density 1) selects with ``lax.top_k`` directly.

  Args:
    x: ``f32[n]``.
    capacity: static payload size, ``1 <= capacity <= n``.
    k: traced or static count ``<= capacity`` to select.
    key: a typed PRNG key for the sample.
    sample_ratio: share of ``x`` sampled, in (0, 1).

  Returns:
    ``(values [capacity], int32 indices [capacity])``; slots past the number
    selected hold value 0 and index ``collectives.EMPTY_INDEX``.
  """
  if capacity >= x.shape[0]:
    return select_topk(x, capacity, k)
  candidates = candidate_capacity(x.shape[0], capacity)
  k = jnp.asarray(k, jnp.int32)
  index, total = threshold_candidates(x, k, key, sample_ratio, candidates)
  enough = total.astype(jnp.float32) >= MIN_FRACTION * k.astype(jnp.float32)
  fits = total <= candidates
  return lax.cond(
      enough & fits,
      lambda: _largest_candidates(x, index, total, k, capacity),
      lambda: select_topk(x, capacity, k))


def _largest_candidates(x, index, total, k, capacity):
  """The ``min(k, total)`` largest magnitudes among the candidates ``index``.

  Exact among them, ties to the lowest index (as ``lax.top_k``), in
  increasing index order; slots past them are empty.
  """
  valid = index != collectives.EMPTY_INDEX
  safe_index = jnp.where(valid, index, 0)
  cand_values = jnp.where(valid, x[safe_index], 0).astype(x.dtype)
  cand_bits = jnp.where(valid, _magnitude_bits(cand_values), -1)
  cut = _kth_largest_bits(cand_bits, jnp.minimum(k, total))
  above = cand_bits > cut
  # Entries equal to the cut fill what is left of k, lowest index first.
  ties = cand_bits == cut
  tie_rank = lax.associative_scan(jnp.add, ties.astype(jnp.int32)) - 1
  keep = above | (ties & (tie_rank < k - jnp.sum(above)))
  rank = lax.associative_scan(jnp.add, keep.astype(jnp.int32)) - 1
  slot = jnp.where(keep, rank, capacity)
  empty = jnp.full(capacity, collectives.EMPTY_INDEX, jnp.int32)
  return (
      jnp.zeros(capacity, x.dtype).at[slot].set(cand_values, mode="drop"),
      empty.at[slot].set(index, mode="drop"),
  )


def exact_sample_ratio(n: int, capacity: int) -> float:
  """The share of ``n`` entries :func:`exact_topk` samples to select ``capacity``."""
  wanted = max(EXACT_SAMPLE_RATIO, _EXACT_SAMPLE_ABOVE / capacity)
  return min(wanted, _EXACT_SAMPLE_MAX)


def exact_topk(
    x: jax.Array, capacity: int, key=None, sample_ratio=None
) -> tuple[jax.Array, jax.Array]:
  """The entries ``lax.top_k(|x|, capacity)`` selects, found by a sampled threshold.

  Steps 1 and 2 of :func:`sampled_topk` (a threshold from a sample, one pass
  compacting the entries above it into ``CANDIDATE_FACTOR * capacity``
  slots), then the ``capacity`` largest candidates. Whenever the count above
  the threshold is at least ``capacity`` and fits the buffer, every entry
  larger than the ``capacity``-th largest is a candidate, so these are the
  exact top-k; otherwise (a sample that missed, or many equal magnitudes)
  it falls back to ``lax.top_k``, under a ``lax.cond`` with no collective
  inside. Either way the result is the same: magnitudes ordered as
  ``lax.top_k`` orders them (by their bits: NaN above ``inf``), ties to the
  lower index, so devices that take different branches still agree. The key
  only moves the sample, never the result.

  Args:
    x: ``f32[n]``.
    capacity: static count to select, ``1 <= capacity <= n``.
    key: a typed PRNG key for the sample (a fixed one when ``None``).
    sample_ratio: share of ``x`` sampled, in (0, 1); by default
      :func:`exact_sample_ratio`.

  Returns:
    ``(values [capacity], int32 indices [capacity])`` in increasing index
    order: the set of :func:`select_topk`, every slot filled.
  """
  n = x.shape[0]
  if capacity >= n:
    return x, jnp.arange(n, dtype=jnp.int32)
  key = jax.random.key(0) if key is None else key
  if sample_ratio is None:
    sample_ratio = exact_sample_ratio(n, capacity)
  candidates = candidate_capacity(n, capacity)
  index, total = threshold_candidates(x, capacity, key, sample_ratio, candidates)

  def exact():
    values, indices = select_topk(x, capacity)
    indices, values = lax.sort((indices, values), num_keys=1)
    return values, indices

  return lax.cond(
      (total >= capacity) & (total <= candidates),
      lambda: _largest_candidates(x, index, total, capacity, capacity), exact)


def _select(x: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """The top-``capacity`` of a bucket: :func:`exact_topk` on large ones, else ``lax.top_k``."""
  if x.shape[0] >= EXACT_FAST_MIN:
    return exact_topk(x, capacity)
  return select_topk(x, capacity)


# ------------------------------------------------------------------ states


class TopKState(NamedTuple):
  """State of :func:`topk`.

  Attributes:
    count: int32 scalar, steps taken (saturating).
    residual: f32 pytree shaped like the parameters, this device's error
      feedback; ``()`` when ``error_feedback=False``.
  """

  count: jax.Array
  residual: optax.Params


class GTopKState(NamedTuple):
  """State of :func:`gtopk`.

  Attributes:
    count: int32 scalar, steps taken (saturating).
    residual: f32 pytree shaped like the parameters, this device's error
      feedback (it differs per device).
  """

  count: jax.Array
  residual: optax.Params


class RandomKState(NamedTuple):
  """State of :func:`randomk`.

  Attributes:
    count: int32 scalar, steps taken (saturating).
    residual: f32 pytree shaped like the parameters, this device's error
      feedback (it differs per device).
    rng_key: uint32 raw key data, split every step; the same on every device.
  """

  count: jax.Array
  residual: optax.Params
  rng_key: jax.Array


# ------------------------------------------------------------------ helpers


def _check_bool(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool, got {value!r}")
  return bool(value)


def _group_size(axes) -> int:
  return math.prod(base.axis_sizes(axes))


# ------------------------------------------------------------------ topk


def topk(
    density: float, axis_name: base.AxisName, error_feedback: bool = True
) -> base.Compressor:
  """Top-k sparsification with a sparse all-gather.

  The gradient is fused into one f32 bucket of ``n`` elements and corrected
  with this device's residual, ``c = g + e``. The ``k = max(1, ceil(density
  * n))`` entries of largest ``|c|`` are selected locally (exactly those of
  ``lax.top_k``; :func:`exact_topk` finds them on large buckets),
  every device's ``(values, indices)`` is all-gathered, and the mean is the
  scatter-add of the ``P * k`` entries divided by ``P``. With error feedback
  the new residual is ``e' = c - s``, ``s`` this device's selected entries
  (``s + e' == c`` bit for bit).

  Args:
    density: share of the gradient each device sends, in (0, 1].
    axis_name: the data-parallel mesh axis, or a pair of axes (one all-gather
      over both).
    error_feedback: keep what was not sent in a per-device residual.

  Returns:
    A :class:`jaxcomp.base.Compressor` with state :class:`TopKState`, whose
    ``update`` returns the mean gradient, identical on every device, in the
    dtype of ``updates``.

  Wire: two all-gathers (f32 values and int32 indices) of ``k`` each,
  ``(P - 1) * 8 k`` bytes per device per step.

  Example::

    tx = optax.chain(jaxcomp.topk(0.01, "data"), optax.sgd(0.1))

  References:
    Aji & Heafield, `Sparse Communication for Distributed Gradient Descent
    <https://arxiv.org/abs/1704.05021>`_, EMNLP 2017; Shi et al.,
    `Understanding Top-k Sparsification in Distributed Deep Learning
    <https://arxiv.org/abs/1911.08772>`_, 2019.
  """
  density = base.check_density(density)
  axes = base.check_axis_name(axis_name)
  use_residual = _check_bool(error_feedback, "error_feedback")

  def init_fn(params):
    residual = error_feedback_lib.init(params) if use_residual else ()
    return TopKState(count=base.zero_count(), residual=residual)

  def update_fn(updates, state, params=None):
    del params
    if use_residual:
      error_feedback_lib.check_matches(updates, state.residual)
    bucket = fusion.Bucket.of(updates)
    n = bucket.size
    k = base.num_selected(density, n)
    size = _group_size(axes)
    finite = base.all_finite(updates)
    if use_residual:
      corrected = error_feedback_lib.compensate(bucket, updates, state.residual)
    else:
      corrected = bucket.flatten(updates)
    values, indices = _select(corrected, k)
    all_values, all_indices = collectives.sparse_allgather(
        base.poison(values, finite), indices, axes
    )
    mean = collectives.densify(all_values, all_indices, n) / size
    result = bucket.unflatten(mean, like=updates)
    residual = state.residual
    if use_residual:
      residual = error_feedback_lib.absorb_sent(bucket, corrected, indices, state.residual)
    new_state = TopKState(count=base.safe_increment(state.count), residual=residual)
    return result, base.keep_if_finite(result, new_state, state)

  def wire_bytes(params, num_devices):
    size = math.prod(base.normalize_axis_sizes(axes, num_devices))
    k = base.num_selected(density, fusion.Bucket.of(params).size)
    return collectives.sparse_allgather_bytes(k, size)

  return base.Compressor(init_fn, update_fn, wire_bytes)


# ------------------------------------------------------------------ gtopk


def gtopk(density: float, axis_name: base.AxisName) -> base.Compressor:
  """Global top-k (gTop-k) sparsification with the butterfly all-reduce.

  Each device corrects its fused gradient with its residual, ``c = g + e``,
  and selects its local top-k. :func:`jaxcomp.collectives.gtopk_allreduce`
  then merges the k-sparse vectors pairwise over ``log2(P)`` rounds, keeping
  the ``k`` largest magnitudes of each sum, so every device ends with the
  same global top-k of the summed sparse vectors; the mean is that vector
  densified and divided by ``P``. Residual put-back, as in the paper: an
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

  Returns:
    A :class:`jaxcomp.base.Compressor` with state :class:`GTopKState`.

  Wire: ``log2(P)`` collective-permutes of ``k`` f32 values and ``k`` int32
  indices, ``log2(P) * 8 k`` bytes per device for power-of-two P; other P
  add two rounds (fold and send-back) for the devices past the largest power
  of two.

  Example::

    tx = optax.chain(jaxcomp.gtopk(1e-3, "data"), optax.sgd(0.1))

  References:
    Shi et al., `A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification for Low Bandwidth Networks
    <https://arxiv.org/abs/1901.04359>`_, ICDCS 2019.
  """
  density = base.check_density(density)
  axes = base.check_axis_name(axis_name)

  def init_fn(params):
    return GTopKState(count=base.zero_count(), residual=error_feedback_lib.init(params))

  def update_fn(updates, state, params=None):
    del params
    error_feedback_lib.check_matches(updates, state.residual)
    bucket = fusion.Bucket.of(updates)
    n = bucket.size
    k = base.num_selected(density, n)
    size = _group_size(axes)
    finite = base.all_finite(updates)
    corrected = error_feedback_lib.compensate(bucket, updates, state.residual)
    values, indices = _select(corrected, k)
    global_values, global_indices = collectives.gtopk_allreduce(
        base.poison(values, finite), indices, k, axes
    )
    mean = collectives.densify(global_values, global_indices, n) / size
    # Membership by a sorted search over k entries, not an n-sized mask.
    members = jnp.sort(global_indices)
    found = members[jnp.minimum(jnp.searchsorted(members, indices), k - 1)]
    sent = jnp.where(found == indices, indices, collectives.EMPTY_INDEX)
    result = bucket.unflatten(mean, like=updates)
    new_state = GTopKState(
        count=base.safe_increment(state.count),
        residual=error_feedback_lib.absorb_sent(bucket, corrected, sent, state.residual),
    )
    return result, base.keep_if_finite(result, new_state, state)

  def wire_bytes(params, num_devices):
    size = math.prod(base.normalize_axis_sizes(axes, num_devices))
    k = base.num_selected(density, fusion.Bucket.of(params).size)
    return collectives.gtopk_allreduce_bytes(k, size)

  return base.Compressor(init_fn, update_fn, wire_bytes)


# ------------------------------------------------------------------ randomk


def random_indices(key: jax.Array, n: int, k: int) -> jax.Array:
  """``k`` distinct indices of ``[0, n)``, uniform, sorted (int32).

  The ``k`` largest of ``n`` uniform draws (a uniform ``k``-subset); all of
  them, in order, when ``k == n``.
  """
  if k == n:
    return jnp.arange(n, dtype=jnp.int32)
  draws = jax.random.uniform(key, (n,))
  if n >= EXACT_FAST_MIN:
    # The same k entries as lax.top_k (the draws are >= 0, their magnitudes),
    # already in increasing order.
    return exact_topk(draws, k)[1]
  _, indices = lax.top_k(draws, k)
  return jnp.sort(indices.astype(jnp.int32))


def randomk(density: float, axis_name: base.AxisName, seed: int = 0) -> base.Compressor:
  """Random-k sparsification: shared random coordinates, one dense all-reduce.

  Every step draws ``k = max(1, ceil(density * n))`` distinct coordinates of
  the fused gradient from the PRNG key in the state. The key is the same on
  every device (it is never folded with ``axis_index``) and is split every
  step, so all devices pick the same coordinates and their ``k`` values are
  averaged with one dense :func:`jaxcomp.collectives.mean` (the 2D-torus
  all-reduce for a pair of axes). Error feedback keeps the rest:
  ``e' = c - s``, ``c = g + e``, ``s`` the values taken.

  Args:
    density: share of the gradient sent, in (0, 1].
    axis_name: the data-parallel mesh axis, or a pair of axes (torus).
    seed: the PRNG seed of the coordinates, an int in ``[0, 2**32)``; it must
      be the same on every device (it is, when ``init`` runs once).

  Returns:
    A :class:`jaxcomp.base.Compressor` with state :class:`RandomKState`.

  Wire: one ring all-reduce of ``k`` f32 values, ``2 (P - 1) / P * 4 k``
  bytes per device (the torus formula of :func:`jaxcomp.allreduce` with
  ``k`` for ``n`` on a pair of axes); no indices travel.

  Example::

    tx = optax.chain(jaxcomp.randomk(0.01, "data", seed=0), optax.sgd(0.1))

  References:
    Stich et al., `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, NeurIPS 2018.
  """
  density = base.check_density(density)
  axes = base.check_axis_name(axis_name)
  seed = base.check_seed(seed)

  def init_fn(params):
    return RandomKState(
        count=base.zero_count(),
        residual=error_feedback_lib.init(params),
        rng_key=base.raw_key(seed),
    )

  def update_fn(updates, state, params=None):
    del params
    error_feedback_lib.check_matches(updates, state.residual)
    bucket = fusion.Bucket.of(updates)
    n = bucket.size
    k = base.num_selected(density, n)
    finite = base.all_finite(updates)
    next_key, draw = jax.random.split(jax.random.wrap_key_data(state.rng_key))
    indices = random_indices(draw, n, k)
    corrected = error_feedback_lib.compensate(bucket, updates, state.residual)
    values = corrected[indices]
    mean_values = collectives.mean(base.poison(values, finite), axes)
    mean = collectives.densify(mean_values, indices, n)
    result = bucket.unflatten(mean, like=updates)
    new_state = RandomKState(
        count=base.safe_increment(state.count),
        residual=error_feedback_lib.absorb_sent(bucket, corrected, indices, state.residual),
        rng_key=jax.random.key_data(next_key),
    )
    return result, base.keep_if_finite(result, new_state, state)

  def wire_bytes(params, num_devices):
    sizes = base.normalize_axis_sizes(axes, num_devices)
    k = base.num_selected(density, fusion.Bucket.of(params).size)
    return collectives.mean_bytes(k, sizes)

  return base.Compressor(init_fn, update_fn, wire_bytes)
