"""Local top-k selection: which entries of a flat bucket a device sends.

Three ways to the same question, with their tunables as arguments
(:class:`Tuning`) and defaults per backend (:func:`tuning_for`):

* :func:`select_topk`: ``lax.top_k`` of the magnitudes, exact.
* :func:`exact_topk`: the same entries, found by a threshold estimated on a
  sample, one compacting pass, and an exact radix search under a ``lax.cond``
  when the sample misses.
* :func:`sampled_topk`: Deep Gradient Compression's sampled threshold (about
  the top k; the exact fallback only when the count above it is far off),
  past the draw of its sample in one custom call where
  :mod:`jaxcomp._src.native` could build it, else in JAX. Its callers pass
  :func:`tuning_for`'s tunables: on GPU and TPU they select with
  ``lax.top_k`` instead (``Tuning.sampled``).

:func:`topk` is what the sparsifiers call: the exact set of ``lax.top_k``, by
the route :func:`tuning_for` picks for the backend: on CPU, buckets of at
least ``exact_min_size`` entries select with :func:`exact_topk`'s entries (one
pass over the bucket instead of a sort-like ``lax.top_k``), in one custom call
where :mod:`jaxcomp._src.native` could build it, else in JAX; smaller ones with
``lax.top_k``; on GPU and TPU every bucket selects with ``lax.top_k``, whose
kernel is faster there than a compaction. ``experiments/bench_selection.py``
measures both routes; the figures are in ``experiments/results/``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxcomp._src import checks
from jaxcomp._src import collectives
from jaxcomp._src import draws
from jaxcomp._src import native

_WORD = 32  # mask bits packed per word by the compaction
# The sample is read in runs of this many consecutive entries (cache lines,
# not scattered words): one run at a random offset in each equal stratum.
_RUN = 32


class Tuning(NamedTuple):
  """The tunables of the sampled selections.

  Attributes:
    oversample: the sampled threshold aims at this many times k, so that the
      count above it rarely falls short of k (its relative spread is about
      ``1 / sqrt(k * sample_ratio)``).
    candidate_factor: candidates above the threshold are compacted into a
      buffer of this many times the capacity; more than that falls back to
      the exact top-k.
    min_fraction: :func:`sampled_topk` falls back to the exact top-k below
      this fraction of k candidates.
    exact_min_size: :func:`topk` selects with :func:`exact_topk` on buckets
      of at least this many entries (``None``: never; ``lax.top_k`` always).
    exact_sample_ratio: the share of the bucket :func:`exact_topk` samples,
      more when that would put fewer than ``exact_sample_above`` sampled
      entries above the threshold (a noisy threshold falls back more often),
      up to ``exact_sample_max``.
    exact_sample_above: see ``exact_sample_ratio``.
    exact_sample_max: see ``exact_sample_ratio``.
    row_block: :func:`topk_per_row` finds each row's ``k`` largest among
      the entries of the ``k`` blocks of this many entries with the largest
      maxima (``None``: ``lax.top_k`` over the whole row).
    product_rows: :func:`topk_per_row_of_product` forms its product this
      many rows at a time and selects in each block at once (``None``: the
      whole product, then the selection).
    argmax_k: :func:`topk_per_row` finds each row's ``k`` largest by ``k``
      argmax reductions, each blind to the entries found before it, while
      ``k`` is at most this and the blocks do not apply (at least 1: ``k =
      1`` is one reduction on every backend).
    sampled: :func:`sampled_topk` selects by its sampled threshold
      (``False``: by ``lax.top_k``, the exact top k, which the threshold
      finds too whenever the count above it reaches k). On GPU one
      ``top_k`` kernel beats the threshold's loops of small kernels and its
      ``lax.cond``, whose predicate XLA:GPU reads on the host: DGC with 25
      MiB buckets on an H200 (``bench_compression_gpu.md``).
    sampled_min_size: with ``sampled``, :func:`sampled_topk` selects by its
      threshold among at least this many entries, and by ``lax.top_k``
      among fewer (``None``: by the threshold at every size). On XLA:CPU,
      below 4,096 entries ``lax.top_k`` takes at most 0.15 ms at DGC's
      densities (0.07-0.14 ms for the threshold), is exact where the
      threshold may send fewer than k, and compiles in under 0.1 s where the
      threshold's loops, compaction and fallback take about 1 s
      (``python -m experiments.bench_selection --small-buckets``).
    native: on CPU, :func:`topk` takes its exact route, :func:`sampled_topk`
      its steps past the draw of its sample and :func:`topk_per_row` its wide
      rows through one custom call each (:mod:`jaxcomp._src.native`,
      compiled from C++ on first use) wherever it is available: the same
      bits in one kernel where the JAX route is 7 to 45, and no compile time
      of its own. Error feedback's packed mask of what was sent
      (:func:`jaxcomp._src.error_feedback.sent_mask`) follows it too.
  """

  oversample: float = 1.25
  candidate_factor: int = 2
  min_fraction: float = 0.8
  exact_min_size: Optional[int] = 1 << 22
  exact_sample_ratio: float = 0.01
  exact_sample_above: int = 256
  exact_sample_max: float = 0.25
  row_block: Optional[int] = 32
  product_rows: Optional[int] = 4096
  argmax_k: int = 8
  sampled: bool = True
  sampled_min_size: Optional[int] = 4096
  native: bool = True


# The CPU default switches to exact_topk where its one pass beats lax.top_k
# (large buckets), ranks rows by blocks or by successive argmaxes, selects in a
# product block by block and samples DGC's threshold; GPUs and TPUs keep
# lax.top_k and whole products (bench_selection.py, bench_compression_gpu.md).
_ACCELERATOR = Tuning(exact_min_size=None, row_block=None, product_rows=None, argmax_k=1,
                      sampled=False, native=False)
_BY_BACKEND = {"cpu": Tuning(), "gpu": _ACCELERATOR, "cuda": _ACCELERATOR,
               "rocm": _ACCELERATOR, "tpu": _ACCELERATOR}


def tuning_for(backend: Optional[str] = None) -> Tuning:
  """The tunables for ``backend`` (``jax.default_backend()`` by default)."""
  return _BY_BACKEND.get(backend or jax.default_backend(), Tuning())


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

  NaN ranks as ``inf``, on every backend, whatever its ``top_k`` makes of
  NaN: a non-finite ``x`` always has one of its non-finite entries selected
  (the key stays f32: XLA:CPU's ``top_k`` of int32 is a full sort, about
  100x slower).

  Returns:
    ``(values [capacity], int32 indices [capacity])``, largest magnitude first;
    empty slots hold value 0 and index ``collectives.EMPTY_INDEX``.
  """
  # Behind a barrier: XLA:CPU makes the TopK kernel of a sort whose every
  # user is the same slice, and a consumer that reads a part of the indices
  # (an order token reads one) would otherwise turn the kernel into a full sort.
  _, indices = lax.top_k(_as_magnitude(_magnitude_key(x)), capacity)
  indices = lax.optimization_barrier(indices)
  values = x[indices]
  indices = indices.astype(jnp.int32)
  if k is None:
    return values, indices
  return _mask_tail(values, indices, k)


# ``inf``'s bits: :func:`_magnitude_key` puts every NaN there.
_INF_BITS = 0x7F800000


def _magnitude_key(x: jax.Array) -> jax.Array:
  """``|x|`` as int32 bits, NaN brought down to ``inf``: ordered and tied like the
  magnitudes with NaN ranked as ``inf``. On XLA:CPU a reduction of these
  integers is vectorised where one of ``where(isnan(|x|), inf, |x|)`` is not
  (a tenth of the time)."""
  return jnp.minimum(lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF, _INF_BITS)


# XLA:CPU splits a reduction of more than this many entries into a tree whose
# first level is a buffer of its own: what feeds the reduction is written out and
# read again, where a reduction of at most this many fuses with it.
_FUSED_REDUCTION = 32


def max_magnitude(rows: jax.Array) -> jax.Array:
  """``f32[m]``: each row's largest ``|entry|`` of ``rows`` (``[m, w]``), NaN counted as
  ``inf``, exact.

  The largest of :func:`_magnitude_key`'s bits, taken over pieces of at most
  32 entries (the row zero-padded to whole pieces), then over the pieces, so
  that on XLA:CPU it fuses with what computes ``rows``: ResNet-50's 25.6M
  corrected entries in rows of 64, 8.5 ms and 2 passes against 51 ms and 4
  for ``max(where(isnan(x), inf, |x|))``.
  """
  width = rows.shape[1]
  if width <= _FUSED_REDUCTION:
    return _as_magnitude(jnp.max(_magnitude_key(rows), axis=1, initial=0))
  pieces = -(-width // _FUSED_REDUCTION)
  padded = jnp.pad(rows, ((0, 0), (0, pieces * _FUSED_REDUCTION - width)))
  key = _magnitude_key(padded.reshape(rows.shape[0], pieces, _FUSED_REDUCTION))
  # Behind a barrier: XLA would merge the two reductions back into one of the row.
  return _as_magnitude(jnp.max(lax.optimization_barrier(jnp.max(key, axis=2)), axis=1))


def _as_magnitude(key: jax.Array) -> jax.Array:
  """The f32 magnitudes of :func:`_magnitude_key`'s bits (XLA:CPU's ``top_k`` of
  int32 is a full sort, about 100x slower than of f32)."""
  return lax.bitcast_convert_type(key, jnp.float32)


def _kth_largest_bits(bits: jax.Array, k, passes: int = 31) -> jax.Array:
  """The ``k``-th largest of non-negative int32 ``bits`` (entries < 0 ignored).

  A radix search from the high bit down: one compare-and-count pass per bit,
  no sort. With all 31 passes the answer ``t`` is the largest value with at
  least ``k`` entries ``>= t`` (0 when fewer than ``k`` entries are valid);
  fewer passes round it down to a multiple of ``2**(31 - passes)``. The
  counts are f32 sums of ones: exact below ``2**24`` entries, and past that
  rounded but never across ``k`` while ``k`` is below ``2**24``.
  """
  def count(candidate, _):
    # The count as a product of the 0/1 mask with itself: one kernel, where
    # XLA:CPU splits a large sum into a tree of reduce-windows (three more).
    above = (bits >= candidate).astype(jnp.float32)
    return jnp.dot(above, above, precision=lax.Precision.HIGHEST)

  return _radix_search(count, k, passes)


def _radix_search(count: Callable[[jax.Array, jax.Array], jax.Array], k,
                  passes: int = 31) -> jax.Array:
  """The largest int32 ``t >= 0`` with ``count(t, i) >= k``, from the high bit down.

  ``count(candidate, i)`` counts the entries at or above ``candidate`` in pass
  ``i`` (a non-increasing function of ``candidate``); one pass per bit, bits 30
  down to ``31 - passes`` (the rest stay 0).
  """
  def body(i, t):
    candidate = t | (jnp.int32(1) << (30 - i))
    return jnp.where(count(candidate, i) >= k, candidate, t)

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


def _pack(x: jax.Array, keep: Callable[[jax.Array], jax.Array], valid=None) -> jax.Array:
  """``uint32[..., len(x) / 32]``: bit ``j`` of word ``w`` is ``keep(key)`` of ``x[32 w + j]``,
  ``key`` its magnitude's (:func:`_magnitude_key`: NaN as ``inf``); ``keep`` may give
  masks along leading axes (``[..., len(x)]``), packed in the same pass."""
  mask = keep(_magnitude_key(x))
  if valid is not None:
    mask = mask & valid
  shifted = (mask.reshape(*mask.shape[:-1], -1, _WORD).astype(jnp.uint32)
             << jnp.arange(_WORD, dtype=jnp.uint32))
  return jnp.sum(shifted, axis=-1, dtype=jnp.uint32)


def _words(x: jax.Array, keep: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """``uint32[..., ceil(len(x) / 32)]``: :func:`_pack` of the whole of ``x``, its last
  word's bits past the end zero. One pass over ``x``, fused with what computes it; no
  ``x``-sized buffer."""
  n = x.shape[0]
  full = n // _WORD
  parts = [_pack(x[:full * _WORD], keep)] if full else []
  tail = n - full * _WORD
  if tail:
    padded = jnp.pad(x[full * _WORD:], (0, _WORD - tail))
    parts.append(_pack(padded, keep, jnp.arange(_WORD) < tail))
  return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


# Prefix sums go up a tree of this many entries per node (see _prefix_sum).
_SCAN_BLOCK = 32


def _prefix_sum(x: jax.Array, exact: bool = False) -> jax.Array:
  """Inclusive prefix sums along the last axis of a non-negative int32 ``x``, in a few kernels
  per level.

  Each row is padded once and cut into blocks of :data:`_SCAN_BLOCK`: one
  product with a triangle of ones gives every block's prefix sums, the
  blocks' totals are summed so one level up (the top level, at most
  :data:`_SCAN_TOP` entries, in one product), and each block adds the total
  before it: about two kernels per level and ``log_32(m)`` levels, where
  ``lax.associative_scan`` makes a few kernels for each of ``log_2(m)``.
  Rows (leading axes) share every kernel. The products run in f32, exact
  while the sums stay below ``2**24``; a larger sum may round but keeps its
  order against any integer below ``2**24`` (the selections compare them
  with slot counts below it, and discard a count above the buffer). With
  ``exact``, in int32: exact below ``2**31``, at 1.2-1.5x the time on XLA:CPU
  (no BLAS kernel; 0.23 against 0.20 ms for 13,108 entries, 4.5 against 2.9 for 2M).
  """
  if exact:
    return _prefix_sum_of(x)
  return _prefix_sum_of(x.astype(jnp.float32)).astype(jnp.int32)


# A constant of the program, not computed in it.
_TRIANGLE = np.triu(np.ones((_SCAN_BLOCK, _SCAN_BLOCK), np.float32))
# The top of the tree sums up to this many entries in one product (at most 1M
# multiply-adds a row): a compaction of 6.5M entries goes up 3 levels where it went
# up 4 with 128, and its candidates' 2 where they went up 3; 4 kernels fewer a
# selection, in the same time (XLA:CPU).
_SCAN_TOP = 1024


def _prefix_sum_of(x: jax.Array) -> jax.Array:
  m = x.shape[-1]
  # Padded once, so that every level below the top divides into blocks.
  unit = 1
  while -(-m // unit) > _SCAN_TOP:
    unit *= _SCAN_BLOCK
  padded = -(-m // unit) * unit
  if padded > m:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - m)])
  return _scan_tree(x)[..., :m]


def _scan_tree(x: jax.Array) -> jax.Array:
  m = x.shape[-1]
  precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  if m <= _SCAN_TOP:
    return jnp.matmul(x, np.triu(np.ones((m, m), x.dtype)), precision=precision)
  within = jnp.matmul(x.reshape(*x.shape[:-1], m // _SCAN_BLOCK, _SCAN_BLOCK),
                      _TRIANGLE.astype(x.dtype), precision=precision)
  totals = within[..., -1]
  within = within + (_scan_tree(totals) - totals)[..., None]
  return within.reshape(x.shape)


def _compact(x: jax.Array, threshold: jax.Array, capacity: int):
  """Indices of the entries whose magnitude key (:func:`_magnitude_key`) is ``>= threshold``,
  the first ``capacity`` (:func:`_compact_where`)."""
  return _compact_where(x, lambda key: key >= threshold, capacity)


def _compact_where(x: jax.Array, keep: Callable[[jax.Array], jax.Array], capacity: int):
  """Indices of the entries whose magnitude key (:func:`_magnitude_key`) ``keep`` holds for,
  the first ``capacity``.

  One pass packs the mask into 32-bit words (:func:`_words`); a prefix sum of the per-word counts
  (``n / 32`` of them, :func:`_prefix_sum`) gives each word's first slot; each output slot then
  finds its word by counting the words that end at or before it (one scatter of ones
  and a prefix sum over the slots: 4 kernels fewer than a binary search's loop, as fast
  at density 0.001 and faster where the slots are many: on 6.5M entries on XLA:CPU an
  exact selection at density 0.1 took 65-71 ms against 97-114, at 0.3 186 against 336)
  and its bit by a popcount search. No ``n``-sized cumsum, scatter or copy. A ``keep``
  that gives masks along leading axes (``[..., n]``) has each compacted, all in the
  same kernels.

  Returns:
    ``(int32 indices [..., capacity] in increasing order, EMPTY_INDEX past
    the count; the count of entries kept [...])``.
  """
  words = _words(x, keep)
  counts = lax.population_count(words).astype(jnp.int32)
  ends = _prefix_sum(counts)
  total = ends[..., -1]
  slots = jnp.arange(capacity, dtype=jnp.int32)
  # Slot s lies in the word of index #{w : ends[w] <= s}: a count of the words
  # ending at each slot (ends past the buffer dropped), summed up the slots, in
  # int32 (it reaches n / 32, past f32's exact integers for n of 2**29 or more).
  ending = jnp.zeros(ends.shape[:-1] + (capacity,), jnp.int32)
  rows = jnp.indices(ends.shape)[:-1]
  ending = ending.at[(*rows, ends)].add(1, mode="drop")
  word = jnp.minimum(_prefix_sum(ending, exact=True), words.shape[-1] - 1)
  at_word = functools.partial(jnp.take_along_axis, indices=word, axis=-1)
  rank = slots - (at_word(ends) - at_word(counts))
  index = word * _WORD + _select_bit(at_word(words), rank)
  return jnp.where(slots < total[..., None], index, collectives.EMPTY_INDEX), total


def sample_size(n: int, sample_ratio: float) -> int:
  """Static size of the sample of :func:`sampled_topk`: ``ceil(sample_ratio * n)``."""
  return max(1, math.ceil(sample_ratio * n))


def candidate_capacity(n: int, capacity: int, tuning: Optional[Tuning] = None) -> int:
  """Static size of the candidate buffer of :func:`sampled_topk`."""
  return min(n, (tuning or Tuning()).candidate_factor * capacity)


def threshold_candidates(
    x: jax.Array, k, key: jax.Array, sample_ratio: float, candidates: int,
    tuning: Optional[Tuning] = None,
) -> tuple[jax.Array, jax.Array]:
  """Steps 1 and 2 of :func:`sampled_topk`: the entries above the sampled threshold.

  Returns:
    ``(int32 indices [candidates], increasing, EMPTY_INDEX past the count;
    the count of entries at or above the threshold)``.
  """
  return _compact(x, sampled_threshold(x, k, key, sample_ratio, candidates, tuning), candidates)


def sampled_threshold(
    x: jax.Array, k, key: jax.Array, sample_ratio: float, candidates: int,
    tuning: Optional[Tuning] = None,
) -> jax.Array:
  """Step 1 of :func:`sampled_topk`: the threshold, an ``int32[]`` magnitude key."""
  positions, rank, most = _sample(x.shape[0], k, key, sample_ratio, candidates, tuning)
  # The sample's largest keys, as many as the largest rank (a traced k is at
  # most the candidates): one top_k kernel, where a radix search is a loop of 16
  # passes and its copies, 8 kernels more a selection. On 6.5M entries (XLA:CPU)
  # it is as fast at density 0.001; the loop takes 0.5 ms at any density, the
  # top_k 1 ms at 0.01 and 4-7 ms at 0.1-0.3 (3-8% of the selection's time).
  largest, _ = lax.top_k(_as_magnitude(_magnitude_key(x[positions])), most)
  # Behind a barrier: read at a traced position, the top_k would become a full sort
  # (:func:`select_topk`).
  largest = lax.optimization_barrier(largest)
  return lax.bitcast_convert_type(largest[rank - 1], jnp.int32)


def _sample(n: int, k, key: jax.Array, sample_ratio: float, candidates: int,
            tuning: Optional[Tuning] = None) -> tuple[jax.Array, jax.Array, int]:
  """Step 1 of :func:`sampled_topk` up to the threshold: ``(int32 positions [s], the
  threshold's rank among their keys (``int32[]``, largest first), the largest rank
  for any k (static))``."""
  size = sample_size(n, sample_ratio)
  runs = -(-size // _RUN)
  stride = n // runs
  if stride >= _RUN:
    # Entry j of run r = j // 32 lies at r * stride + (run r's draw) + j % 32:
    # formed entry by entry (each run's draw hashed again for each of its
    # entries), so that the positions are one elementwise kernel, not the
    # draws and then their broadcast.
    entry = lax.iota(jnp.int32, size)
    run = entry // _RUN
    positions = (run * stride + draws.integers_at(key, run, stride - _RUN + 1)
                 + entry % _RUN)
  else:
    positions = draws.integers(key, size, n)
  oversample = (tuning or Tuning()).oversample
  target = jnp.ceil(oversample * jnp.asarray(k, jnp.float32) * (size / n))
  target = jnp.clip(target, 1, size).astype(jnp.int32)
  bound = k if isinstance(k, int) else candidates
  most = min(size, max(1, math.ceil(oversample * bound * size / n)))
  return positions, jnp.minimum(target, most), most


def sampled_topk(
    x: jax.Array, capacity: int, k, key: jax.Array, sample_ratio: float,
    tuning: Optional[Tuning] = None, *, size: Optional[int] = None,
) -> tuple[jax.Array, jax.Array]:
  """About the ``k`` largest magnitudes of ``x``, by a sampled threshold (DGC).

  1. Sample ``s = ceil(sample_ratio * n)`` entries: ``x`` is cut into
     ``ceil(s / 32)`` equal strata and ``key`` draws one run of 32
     consecutive entries at a uniform offset in each (a stratified cluster
     sample, read in increasing order, so memory traffic stays about ``4 s``
     bytes; with strata shorter than a run, ``s`` uniform positions). The
     threshold ``t`` is the ``ceil(oversample * k * s / n)``-th largest
     magnitude of the sample (NaN as ``inf``), from one ``lax.top_k`` of it.
  2. Count and compact the entries ``|x| >= t`` into a candidate buffer of
     ``candidate_factor * capacity`` (:func:`_compact`: one pass over ``x``).
  3. If the count is within ``[min_fraction * k, candidate_factor *
     capacity]``, keep the ``k`` largest candidates (exact among them, so the
     result is the exact top-k whenever the count reaches ``k``; between
     ``min_fraction * k`` and ``k`` every candidate is sent). Otherwise fall
     back to the exact top ``k`` of ``x`` by a radix search over the whole of
     it (:func:`_topk_by_radix`, in increasing index order). The choice is a
     ``lax.cond`` with no collective inside, so devices may take different
     branches.

  With ``tuning.native``, all but the draw of the sample's positions is one
  custom call where it is available (:func:`jaxcomp._src.native.sampled_topk`):
  the same values and indices bit for bit, in one kernel where the sample's
  keys, its top_k, the compaction, the candidates' selection and the fallback
  are about 45, none of them compiled.

  A capacity of ``n`` (density 1), ``tuning.sampled`` false, or fewer than
  ``tuning.sampled_min_size`` entries, selects with ``lax.top_k`` directly
  (:func:`select_topk`: largest first).

  Args:
    x: ``f32[n]``.
    capacity: static payload size, ``1 <= capacity <= n``.
    k: traced or static count ``<= capacity`` to select.
    key: a typed PRNG key for the sample.
    sample_ratio: share of ``x`` sampled, in (0, 1).
    tuning: the tunables (:class:`Tuning`; ``sampled``, ``sampled_min_size``,
      ``oversample``, ``candidate_factor`` and ``min_fraction`` are read). By default
      ``Tuning()``, sampled on every backend; :func:`tuning_for` gives the
      backend's.
    size: select among ``x[:size]`` only (default: all of ``x``). A caller
      whose bucket ends in leaves it does not sparsify passes the whole
      bucket: the head is read where it lies, never copied out.

  Returns:
    ``(values [capacity], int32 indices [capacity])``; slots past the number
    selected hold value 0 and index ``collectives.EMPTY_INDEX``.
  """
  if size is not None and not (isinstance(size, int) and 1 <= size <= x.shape[0]):
    raise ValueError(f"`size` must be an int in [1, {x.shape[0]}] (the length of `x`),"
                     f" got {size!r}")
  if size is None or size == x.shape[0]:
    size = x.shape[0]
  else:
    # XLA rewrites a slice of a concatenation into a second concatenation
    # (an n-sized copy); behind the barrier the head is read in place.
    x = lax.optimization_barrier(x)
  tuning = tuning or Tuning()
  if not _samples(size, capacity, tuning):
    return select_topk(x[:size], capacity, k)
  candidates = candidate_capacity(size, capacity, tuning)
  if native_route(tuning):
    positions, rank, candidates = call_sample(size, capacity, k, key, sample_ratio, tuning)
    return native.sampled_topk(x, capacity, k, positions, rank, size=size,
                               candidates=candidates, min_fraction=tuning.min_fraction)
  index, total = threshold_candidates(x[:size], k, key, sample_ratio, candidates, tuning)
  k = jnp.asarray(k, jnp.int32)
  enough = total.astype(jnp.float32) >= tuning.min_fraction * k.astype(jnp.float32)
  fits = total <= candidates
  # The branches take the whole ``x`` and slice it inside: a slice handed to
  # a ``cond`` would be copied out first, an n-sized copy every step.
  return lax.cond(
      enough & fits,
      lambda: _largest_candidates(x, index, total, k, capacity),
      lambda: _topk_by_radix(x, capacity, k, size))


def _samples(n: int, capacity: int, tuning: Tuning) -> bool:
  """:func:`sampled_topk` of ``n`` entries at ``capacity`` draws a sample (else it is
  :func:`select_topk`)."""
  small = tuning.sampled_min_size is not None and n < tuning.sampled_min_size
  return capacity < n and tuning.sampled and not small


def sampled_in_call(n: int, capacity: int, tuning: Tuning) -> bool:
  """:func:`sampled_topk` of ``n`` entries at ``capacity`` is one native custom call after
  the draw of its sample (:func:`call_sample`), which a caller may make of its own."""
  return _samples(n, capacity, tuning) and native_route(tuning)


def call_sample(n: int, capacity: int, k, key: jax.Array, sample_ratio: float,
                tuning: Tuning) -> tuple[jax.Array, jax.Array, int]:
  """What :func:`sampled_topk`'s custom call takes besides the entries, where
  :func:`sampled_in_call`: ``(int32 positions [s], the threshold's rank, the
  candidates' capacity)`` (:func:`jaxcomp._src.native.sampled_topk`)."""
  candidates = candidate_capacity(n, capacity, tuning)
  positions, rank, _ = _sample(n, k, key, sample_ratio, candidates, tuning)
  return positions, rank, candidates


def _largest_candidates(x, index, total, k, capacity):
  """The ``min(k, total)`` largest magnitudes among the candidates ``index``.

  Exact among them, NaN ranked as ``inf``, ties to the lowest index (as
  ``lax.top_k``), in increasing index order; slots past them are empty.
  """
  valid = index != collectives.EMPTY_INDEX
  safe_index = jnp.where(valid, index, 0)
  cand_values = jnp.where(valid, x[safe_index], 0).astype(x.dtype)
  cand_bits = jnp.where(valid, _magnitude_key(cand_values), -1)
  cut = _kth_largest_bits(cand_bits, jnp.minimum(k, total))
  above = cand_bits > cut
  ties = cand_bits == cut
  # One prefix sum of both masks: ``above_before[i]`` and ``ties_before[i]``
  # count the entries up to ``i``. Ties fill what is left of k, lowest index
  # first, so a tie is kept while its count is within ``left``, and an
  # entry's slot is the kept entries up to it.
  above_before, ties_before = _prefix_sum(jnp.stack([above, ties]).astype(jnp.int32))
  left = k - above_before[-1]
  keep = above | (ties & (ties_before <= left))
  slot = jnp.where(keep, above_before + jnp.minimum(ties_before, left) - 1, capacity)
  empty = jnp.full(capacity, collectives.EMPTY_INDEX, jnp.int32)
  return (
      jnp.zeros(capacity, x.dtype).at[slot].set(cand_values, mode="drop"),
      empty.at[slot].set(index, mode="drop"),
  )


def exact_sample_ratio(n: int, capacity: int, tuning: Optional[Tuning] = None) -> float:
  """The share of ``n`` entries :func:`exact_topk` samples to select ``capacity``."""
  del n
  tuning = tuning or Tuning()
  wanted = max(tuning.exact_sample_ratio, tuning.exact_sample_above / capacity)
  return min(wanted, tuning.exact_sample_max)


def exact_topk(
    x: jax.Array, capacity: int, key=None, sample_ratio=None,
    tuning: Optional[Tuning] = None, k: Optional[int] = None,
) -> tuple[jax.Array, jax.Array]:
  """The entries ``lax.top_k(|x|, k)`` selects, found by a sampled threshold.

  Steps 1 and 2 of :func:`sampled_topk` (a threshold from a sample, one pass
  compacting the entries above it into ``candidate_factor * capacity``
  slots), then the ``k`` largest candidates. Whenever the count above
  the threshold is at least ``k`` and fits the buffer, every entry
  larger than the ``k``-th largest is a candidate, so these are the
  exact top-k; otherwise (a sample that missed, or many equal magnitudes)
  it falls back to a radix search over the whole of ``x``
  (:func:`_topk_by_radix`), under a ``lax.cond`` with no collective inside.
  Either way gives the same set, ranked by magnitude (NaN as ``inf``, as
  :func:`select_topk`), ties to the lower index, so devices that take different
  branches still agree, and a non-finite ``x`` has a non-finite entry
  selected. The key only moves the sample, never the result.

  Args:
    x: ``f32[n]``.
    capacity: static count to select, ``1 <= capacity <= n``.
    key: a typed PRNG key for the sample (a fixed one when ``None``).
    sample_ratio: share of ``x`` sampled, in (0, 1); by default
      :func:`exact_sample_ratio`.
    tuning: the tunables (:class:`Tuning`).
    k: how many to select, ``1 <= k <= capacity`` (static or traced; by
      default ``capacity``): callers whose buckets differ in ``k`` select in
      one shape (:func:`shared_length`).

  Returns:
    ``(values [capacity], int32 indices [capacity])``: the set of
    :func:`select_topk` (for a finite ``x``) in its first ``k`` slots, in
    increasing index order; slots past ``k`` hold value 0 and index
    ``collectives.EMPTY_INDEX``.
  """
  n = x.shape[0]
  if capacity >= n and (k is None or (isinstance(k, int) and k >= n)):
    return x, jnp.arange(n, dtype=jnp.int32)
  k = capacity if k is None else k
  tuning = tuning or Tuning()
  key = jax.random.key(0) if key is None else key
  if sample_ratio is None:
    sample_ratio = exact_sample_ratio(n, capacity, tuning)
  candidates = candidate_capacity(n, capacity, tuning)
  index, total = threshold_candidates(x, capacity, key, sample_ratio, candidates, tuning)

  return lax.cond(
      (total >= k) & (total <= candidates),
      lambda: _largest_candidates(x, index, total, k, capacity),
      lambda: _topk_by_radix(x, capacity, k))


def _topk_by_radix(x: jax.Array, capacity: int, k=None,
                   size: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
  """The ``k`` (default ``capacity``) largest magnitude keys of ``x[:size]``
  (:func:`_magnitude_key`: NaN as ``inf``), ties to the lower index, in increasing
  index order, by passes over ``x`` alone (each reads the head where it lies: a
  slice handed to the loop would be copied out first).

  The fallback of :func:`exact_topk` and :func:`sampled_topk`. The ``k``-th
  largest key ``t`` by a radix search of 31 passes, each counting the entries
  at or above a candidate in :func:`_words` (a barrier keeps the keys inside
  the loop: hoisted out of it they would be a buffer of ``x``'s size); then
  every entry above ``t`` and the first of those equal to it, both sets
  compacted in one more pass. No buffer the size of ``x`` is made, where
  ``lax.top_k`` needs the magnitudes written out first: on XLA:CPU that buffer,
  allocated for the branch whether it runs or not, took memory of its own that
  the mean's zeros then took too, where they would otherwise share the
  corrected gradient's (top-k on ResNet-50: 3.0 to 2.0 gradients' worth of new
  memory a step, 57,000-70,000 to 25,000-34,000 page faults). The search
  takes about the wall time of ``lax.top_k`` and more CPU time (25.6M equal
  magnitudes on 2 cores: 138 against 133 ms, 248 against 156 CPU ms,
  ``python -m experiments.bench_selection``), and runs only when the sample
  misses.

  Returns:
    ``(values [capacity], int32 indices [capacity])``; slots past ``k`` hold
    value 0 and index ``collectives.EMPTY_INDEX``.
  """
  k = capacity if k is None else k
  size = x.shape[0] if size is None else size

  def at_least(candidate, i):
    seen, _ = lax.optimization_barrier((x, i))
    words = _words(seen[:size], lambda key: key >= candidate)
    return jnp.sum(lax.population_count(words).astype(jnp.int32))

  cut = _radix_search(at_least, k)
  # Both sets in one pass and one compaction's kernels.
  (above, ties), (above_count, _) = _compact_where(
      x[:size], lambda key: jnp.stack([key > cut, key == cut]), capacity)
  slot = jnp.arange(capacity, dtype=jnp.int32)
  # Fewer than ``k`` lie above the cut; the first ties fill the rest.
  ties = jnp.where(slot < k - above_count, ties, collectives.EMPTY_INDEX)
  indices = lax.sort(jnp.concatenate([above, ties]))[:capacity]
  valid = indices != collectives.EMPTY_INDEX
  return jnp.where(valid, x[jnp.where(valid, indices, 0)], 0).astype(x.dtype), indices


def topk(
    x: jax.Array, capacity: int, tuning: Optional[Tuning] = None, k: Optional[int] = None,
) -> tuple[jax.Array, jax.Array]:
  """The entries ``lax.top_k(|x|, k)`` selects, by the backend's fastest route.

  :func:`exact_topk`'s entries on buckets of at least ``tuning.exact_min_size``
  entries (on CPU, 4M; with ``tuning.native``, by the custom call of
  :mod:`jaxcomp._src.native` where it is available, bit for bit the same),
  ``lax.top_k`` otherwise and on GPU and TPU (the defaults of
  :func:`tuning_for`). The set is the same either way; the order of the slots
  is not (largest first, or increasing index).

  Args:
    x: ``f32[n]``.
    capacity: static count of slots, ``1 <= capacity <= n``.
    tuning: the tunables; by default those of the backend tracing the call.
    k: how many to select, ``1 <= k <= capacity``; by default ``capacity``.

  Returns:
    ``(values [capacity], int32 indices [capacity])``, the selected in the
    first ``k`` slots; slots past ``k`` hold value 0 and index
    ``collectives.EMPTY_INDEX``.
  """
  tuning = tuning_for() if tuning is None else tuning
  if isinstance(k, int) and k == capacity:
    k = None  # every slot: no mask in the program
  if tuning.exact_min_size is not None and x.shape[0] >= tuning.exact_min_size:
    if native_route(tuning):
      return native.topk(x, capacity, k)
    return exact_topk(x, capacity, tuning=tuning, k=k)
  return select_topk(x, capacity, k)


def shared_length(n: int, granule: int, tuning: Optional[Tuning] = None) -> int:
  """The length a bucket of ``n`` entries is zero-padded to before :func:`topk`.

  Where :func:`topk` takes the exact route (:func:`exact_topk`, on CPU from
  ``tuning.exact_min_size`` entries on), ``n`` rounded up to a multiple of
  ``granule``, else ``n``. Buckets of about one size then select in one shape
  (the same length, and the same capacity when the caller derives it from
  the length and passes each bucket's ``k``), and XLA:CPU compiles a kernel
  once for all its copies of one shape: ResNet-50's three buckets of 6.56M to
  6.83M entries (25 MiB buckets, ``granule`` a 16th of the cap) share one
  selection, and top-k's step compiles in 5.6 s where it took 8.1 s, in one
  process. The padding is zeros, which rank below every entry of the bucket
  (ties go to the lower index), so the selection is unchanged; it costs
  passes over at most ``granule`` more entries. Where the exact route is the
  native custom call (``tuning.native``), which compiles nothing per shape,
  ``n``: no padding.
  """
  tuning = tuning_for() if tuning is None else tuning
  if tuning.exact_min_size is None or n < tuning.exact_min_size:
    return n
  if native_route(tuning):
    return n
  return -(-n // granule) * granule


def native_route(tuning: Optional[Tuning] = None) -> bool:
  """The custom calls of :mod:`jaxcomp._src.native` are asked for (``tuning.native``;
  by default the tracing backend's :func:`tuning_for`) and built here."""
  tuning = tuning_for() if tuning is None else tuning
  return tuning.native and native.available()


def chunks(n: int, chunk_size: int, density: float) -> tuple[int, int, int]:
  """``(chunk, count, k)`` of a bucket of ``n`` entries cut into chunks for a per-chunk top-k.

  ``chunk``: entries per chunk, ``min(chunk_size, n)``; ``count``: chunks,
  the last one zero-padded; ``k = max(1, ceil(density * chunk))`` entries
  kept in each.
  """
  chunk = min(chunk_size, n)
  return chunk, -(-n // chunk), checks.num_selected(density, chunk)


def chunked_length(chunk_size: int, density: float) -> Callable:
  """A chunked method's ``flat_length`` (:attr:`jaxcomp.protocol.Method.flat_length`):
  its bucket padded to whole chunks (:func:`chunks`).

  The last chunk's zeros then come with the fused gradient, which error
  feedback corrects in place: no second buffer of the bucket for the padding.
  """

  def length(bucket, num_devices: int) -> int:
    del num_devices
    chunk, count, _ = chunks(bucket.size, chunk_size, density)
    return chunk * count

  return length


def topk_per_row(rows: jax.Array, k: int,
                 tuning: Optional[Tuning] = None) -> tuple[jax.Array, jax.Array]:
  """``(values [m, k], int32 positions [m, k])``: each row's ``k`` entries of largest
  magnitude, largest first, the lowest position first on a tie (``lax.top_k``).

  NaN ranks as ``inf``, as in :func:`select_topk`: a row that is not finite
  always has one of its non-finite entries selected.

  The same positions by every route: with ``tuning.row_block`` (on CPU by
  default) and rows of at least ``4 k`` such blocks, one native custom call
  where ``tuning.native`` asks for it and it could be built
  (:func:`jaxcomp._src.native.topk_per_row`: one kernel, where the next
  route is about seven) for f32 rows, else :func:`_topk_per_row_by_blocks`;
  else, for ``k`` up to ``tuning.argmax_k`` (8 on CPU, 1 elsewhere),
  :func:`_topk_per_row_by_argmax`; else ``lax.top_k`` of the row. On XLA:CPU,
  over 25.6M entries, ``k = 1`` is about 4.5x faster than an f32 argmax and
  ``lax.top_k``, and DeMo's rows (``k = 2`` of 64) 2.9x faster than ``lax.top_k``
  (``python -m experiments.bench_selection``).

  ``tuning``: the tunables (``row_block`` and ``argmax_k`` are read); by default
  those of the backend tracing the call.
  """
  tuning = tuning_for() if tuning is None else tuning
  width = rows.shape[1]
  if not (isinstance(k, int) and 1 <= k <= width):
    raise ValueError(f"`k` must be an int in [1, {width}] (the row length), got {k!r}")
  block = tuning.row_block
  if block is not None and not (isinstance(block, int) and block >= 1):
    raise ValueError(f"`tuning.row_block` must be None or an int >= 1, got {block!r}")
  if not (isinstance(tuning.argmax_k, int) and tuning.argmax_k >= 1):
    raise ValueError(f"`tuning.argmax_k` must be an int >= 1, got {tuning.argmax_k!r}")
  if native_rows(rows, k, tuning):
    return native.topk_per_row(rows, k)
  key = _magnitude_key(rows)
  if _wide(width, k, block):
    positions = _topk_per_row_by_blocks(key, k, block)
  elif k <= tuning.argmax_k:
    positions = _topk_per_row_by_argmax(key, k)
  else:
    _, positions = lax.top_k(_as_magnitude(key), k)
  return jnp.take_along_axis(rows, positions, axis=1), positions


def _wide(width: int, k: int, block: Optional[int]) -> bool:
  """Rows of ``width`` are selected from by blocks of ``block`` (:func:`topk_per_row`)."""
  return k > 1 and block is not None and width % block == 0 and width >= 4 * k * block


def native_rows(rows: jax.Array, k: int, tuning: Optional[Tuning] = None) -> bool:
  """:func:`topk_per_row` of ``rows`` (``[m, w]``) is the native custom call: f32 rows
  wide enough for the blocks' route, where :func:`native_route` holds."""
  tuning = tuning_for() if tuning is None else tuning
  return (_wide(rows.shape[1], k, tuning.row_block) and rows.dtype == jnp.float32
          and native_route(tuning))


# topk_per_row_of_product loops over products of at least this many blocks: a
# smaller one is a few MiB, where the loop's own kernels cost more than the
# buffer (DeMo's 64-wide rows, alone in a program on XLA:CPU: 16,533 rows in
# 1.7 ms whole, 3.0 ms by blocks of 4,096; 399,329 rows in 80 ms whole, 53 ms
# by blocks).
_PRODUCT_BLOCKS = 8


def topk_per_row_of_product(rows: jax.Array, matrix: jax.Array, k: int,
                            tuning: Optional[Tuning] = None) -> tuple[jax.Array, jax.Array]:
  """:func:`topk_per_row` of ``rows @ matrix`` (``[m, w]`` and ``[w, v]``); on CPU, for
  many rows, without writing the product out whole.

  With ``tuning.product_rows`` (on CPU by default) and at least
  :data:`_PRODUCT_BLOCKS` times as many rows, a loop forms the product of
  that many rows at a time and selects in it while it is in cache; the last
  block ends at row ``m`` and so selects again some rows of the one before,
  alike. A row's product does not depend on the rows beside it, so the
  values are those of the whole product, up to the order in which a matrix
  product sums (the same bits on XLA:CPU for DeMo's 64-wide rows). On XLA:CPU
  the whole product is a buffer of ``m v`` entries, new memory every step,
  written once and read back: with the loop (and its padding in the fused
  gradient, :func:`chunked_length`) DeMo's step on ResNet-50 reads and writes
  8.2 gradients' worth of memory where it read and wrote 11.3, and allocates
  2.0 gradients' worth anew where it allocated 3.0.

  Returns ``(values [m, k], int32 positions [m, k])`` as :func:`topk_per_row`.
  """
  tuning = tuning_for() if tuning is None else tuning
  block = tuning.product_rows
  if block is not None and not (isinstance(block, int) and block >= 1):
    raise ValueError(f"`tuning.product_rows` must be None or an int >= 1, got {block!r}")
  count = rows.shape[0]
  if block is None or count < _PRODUCT_BLOCKS * block:
    return topk_per_row(rows @ matrix, k, tuning)

  def select(i, found):
    values, positions = found
    start = jnp.minimum(i * block, count - block)
    part = lax.dynamic_slice_in_dim(rows, start, block)
    part_values, part_positions = topk_per_row(part @ matrix, k, tuning)
    return (lax.dynamic_update_slice_in_dim(values, part_values, start, 0),
            lax.dynamic_update_slice_in_dim(positions, part_positions, start, 0))

  empty = (jnp.zeros((count, k), jnp.result_type(rows, matrix)),
           jnp.zeros((count, k), jnp.int32))
  return lax.fori_loop(0, -(-count // block), select, empty)


def _topk_per_row_by_argmax(key: jax.Array, k: int) -> jax.Array:
  """``int32 [m, k]``: each row's ``lax.top_k`` positions of ``key`` (``int32 [m, w]``,
  :func:`_magnitude_key`), by ``k`` argmax reductions.

  An argmax gives the row's largest key at its lowest position, ``top_k``'s
  first; the next one reads the row with the positions found so far set to
  -1, below every key (all are at least 0), and gives ``top_k``'s next. Each
  reduction reads the row again, so this pays for small ``k`` only: on
  XLA:CPU over 25.6M entries, against ``lax.top_k``, 2.4x faster for rows of
  64 at ``k = 8`` (1.6x at 32), 1.1x for rows of 512 at ``k = 8`` (0.8x at
  16), 0.9x for rows of 1024 at ``k = 8``.
  """
  column = lax.broadcasted_iota(jnp.int32, key.shape, 1)
  found = []
  for _ in range(k):
    # Every earlier position masked anew on the unmasked key: each reduction
    # then reads the row itself, no masked copy of it.
    seen = functools.reduce(jnp.logical_or, [column == f for f in found], False)
    found.append(jnp.argmax(jnp.where(seen, -1, key), axis=1, keepdims=True).astype(jnp.int32))
  return jnp.concatenate(found, axis=1) if k > 1 else found[0]


def _topk_per_row_by_blocks(key: jax.Array, k: int, block: int) -> jax.Array:
  """``int32 [m, k]``: each row's ``lax.top_k`` positions of ``key`` (``int32 [m, w]``,
  :func:`_magnitude_key`; ``w`` a multiple of ``block``), found among ``k`` blocks.

  Order entries by magnitude, then by lower position; each block of
  ``block`` consecutive entries by its first entry in that order (its
  maximum). An entry of the row's first ``k`` lies in one of the first ``k``
  blocks: a block after those has ``k`` blocks before it, whose first
  entries are ``k`` entries before any of its own. So ``lax.top_k`` of the
  blocks' maxima (ties: the lower block, the lower positions) names the
  blocks, and ``lax.top_k`` of their entries, laid out in position order,
  picks the same entries in the same order as ``lax.top_k`` of the row:
  one reduction over the row and two ``top_k`` of ``w / block`` and
  ``k block`` entries.
  """
  rows, width = key.shape
  maxima = jnp.max(key.reshape(rows, width // block, block), axis=2)
  _, blocks = lax.top_k(_as_magnitude(maxima), k)
  starts = jnp.sort(blocks, axis=1).astype(jnp.int32) * block
  positions = (starts[:, :, None] + jnp.arange(block, dtype=jnp.int32)).reshape(rows, k * block)
  _, picked = lax.top_k(_as_magnitude(jnp.take_along_axis(key, positions, axis=1)), k)
  return jnp.take_along_axis(positions, picked, axis=1)


def flat_positions(positions: jax.Array, chunk: int) -> jax.Array:
  """Positions inside each row of ``[..., m, k]`` (any int dtype) as int32 positions in the
  flat ``m * chunk`` layout, row after row (:func:`chunked_length`)."""
  starts = jnp.arange(positions.shape[-2], dtype=jnp.int32)[:, None] * chunk
  return positions.astype(jnp.int32) + starts
