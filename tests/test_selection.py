"""The local selections of jaxcomp.selection against numpy and ``lax.top_k``."""

import functools
import math

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import hlo_counts
from jaxcomp import collectives
from jaxcomp._src import selection
import harness

EMPTY = collectives.EMPTY_INDEX


def _normal(n, seed):
  return np.random.default_rng(seed).normal(size=n).astype(np.float32)


def _assert_same_as_lax_top_k(x, capacity, values, indices):
  """The set ``lax.top_k`` selects (ties and NaN ordered alike), in index order."""
  x = np.asarray(x)
  _, want = jax.lax.top_k(jnp.abs(jnp.asarray(x)), capacity)
  want = np.sort(np.asarray(want))
  np.testing.assert_array_equal(np.asarray(indices), want)
  harness.assert_bitwise_equal(values, x[want])


# ------------------------------------------------------------------ tuning


def test_backend_defaults_are_the_documented_ones():
  """On CPU exact_topk from 4M entries on, rows ranked by blocks of 32 or by up to 8
  argmaxes, and DGC's threshold sampled; none of them on GPU or TPU (k = 1's one
  argmax on every backend)."""
  assert selection.tuning_for("cpu").exact_min_size == 1 << 22
  assert selection.tuning_for("cpu").row_block == 32
  assert selection.tuning_for("cpu").argmax_k == 8
  assert selection.tuning_for("cpu").product_rows == 4096
  assert selection.tuning_for("cpu").sampled
  assert selection.tuning_for("cpu").sampled_min_size == 4096
  for backend in ("gpu", "cuda", "rocm", "tpu"):
    assert selection.tuning_for(backend).exact_min_size is None
    assert selection.tuning_for(backend).row_block is None
    assert selection.tuning_for(backend).product_rows is None
    assert selection.tuning_for(backend).argmax_k == 1
    assert not selection.tuning_for(backend).sampled
  assert selection.tuning_for() == selection.tuning_for(jax.default_backend())
  assert selection.tuning_for("an-unknown-backend") == selection.Tuning()


def test_sizes_follow_the_tuning():
  assert selection.sample_size(1000, 0.01) == 10
  assert selection.sample_size(1001, 0.01) == 11
  assert selection.sample_size(10, 0.01) == 1
  assert selection.candidate_capacity(1000, 100) == 2 * 100
  assert selection.candidate_capacity(150, 100) == 150
  assert selection.candidate_capacity(1000, 100, selection.Tuning(candidate_factor=3)) == 300
  # max(exact_sample_ratio, exact_sample_above / capacity), at most exact_sample_max.
  assert selection.exact_sample_ratio(10**6, 100_000) == 0.01
  assert selection.exact_sample_ratio(10**6, 10_000) == 256 / 10_000
  assert selection.exact_sample_ratio(10**6, 1000) == 0.25
  assert selection.exact_sample_ratio(
      10**6, 10_000, selection.Tuning(exact_sample_above=1000)) == 0.1


@pytest.mark.parametrize("n", [4095, 4096, 4097])
def test_topk_is_the_set_of_lax_top_k_below_and_above_exact_min_size(n):
  """Below the size: lax.top_k itself (largest first); from it on: exact_topk (index order)."""
  k = 40
  tuning = selection.Tuning(exact_min_size=4096)
  x = _normal(n, n)
  values, indices = jax.jit(lambda x: selection.topk(x, k, tuning))(jnp.asarray(x))
  want = harness.np_topk(x, k)
  if n >= tuning.exact_min_size:
    np.testing.assert_array_equal(np.asarray(indices), np.sort(want))
  else:
    np.testing.assert_array_equal(np.asarray(indices), want)
  _assert_same_as_lax_top_k(x, k, np.asarray(values)[np.argsort(indices)], np.sort(indices))


def test_topk_never_takes_the_sampled_route_without_a_size():
  k = 40
  x = _normal(5000, 1)
  tuning = selection.Tuning(exact_min_size=None)
  _, indices = jax.jit(lambda x: selection.topk(x, k, tuning))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(indices), harness.np_topk(x, k))


def test_topk_reads_the_backend_tuning_by_default(monkeypatch):
  k = 40
  x = _normal(5000, 2)
  monkeypatch.setattr(selection, "tuning_for",
                      lambda backend=None: selection.Tuning(exact_min_size=5000))
  _, indices = jax.jit(lambda x: selection.topk(x, k))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(indices), np.sort(harness.np_topk(x, k)))


# ------------------------------------------------------------------ select_topk


def test_select_topk_masks_to_k():
  x = jnp.asarray(_normal(500, 0))
  values, indices = jax.jit(lambda x, k: selection.select_topk(x, 20, k))(x, 12)
  want = harness.np_topk(np.asarray(x), 12)
  np.testing.assert_array_equal(np.asarray(indices[:12]), want)
  harness.assert_bitwise_equal(values[:12], np.asarray(x)[want])
  assert np.all(np.asarray(indices[12:]) == EMPTY) and not np.any(np.asarray(values[12:]))


def test_select_topk_stays_one_kernel_when_a_consumer_reads_one_index():
  """XLA:CPU forms its TopK kernel from a sort whose users all take the same slice.
  A consumer that reads one index (the next bucket's order token, when the all-gather
  on one device is the indices themselves) left a full sort of the bucket: gTop-k's
  first 25 MiB bucket on ResNet-50 took 330-340 ms a step against 124-134."""
  if jax.default_backend() != "cpu":
    pytest.skip("the TopK rewrite of XLA:CPU")
  n, k = 1 << 16, 100

  def selected_and_one_index_read(x):
    values, indices = selection.select_topk(x, k)
    return values, indices, indices[0].astype(jnp.float32) * 0

  x = jnp.asarray(_normal(n, 1))
  text = jax.jit(selected_and_one_index_read).lower(x).compile().as_text()
  assert 'custom_call_target="TopK"' in text and " sort(" not in text
  values, indices, _ = selected_and_one_index_read(x)
  want = harness.np_topk(np.asarray(x), k)
  np.testing.assert_array_equal(np.sort(np.asarray(indices)), np.sort(want))
  harness.assert_bitwise_equal(values, np.asarray(x)[np.asarray(indices)])


# ------------------------------------------------------------------ the sampled threshold


@pytest.mark.parametrize("n", [31, 32, 1000, 4099])
def test_compact_matches_nonzero(n):
  x = _normal(n, n)
  threshold = np.float32(1.0)
  bits = jax.lax.bitcast_convert_type(jnp.float32(threshold), jnp.int32)
  capacity = max(1, n // 4)
  index, total = jax.jit(selection._compact, static_argnums=2)(jnp.asarray(x), bits, capacity)
  want = np.nonzero(np.abs(x) >= threshold)[0]
  assert int(total) == len(want)
  got = np.asarray(index)
  np.testing.assert_array_equal(got[:min(capacity, len(want))], want[:capacity])
  assert np.all(got[len(want):] == EMPTY)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(m=st.one_of(st.integers(1, 40_000), st.integers(1_000_000, 1_200_000)),
                  high=st.sampled_from([1, 8]), seed=st.integers(0, 2**16))
def test_prefix_sum_is_numpy_s_cumsum_exactly(m, high, seed):
  """One to three levels of blocks below the top (past 1M entries), every sum below
  2**24: exact."""
  x = np.random.default_rng(seed).integers(0, high + 1, m).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(jax.jit(selection._prefix_sum)(x)), np.cumsum(x))


def test_prefix_sum_past_2_24_keeps_its_order_against_smaller_counts():
  """Sums past 2**24 may round, never below a count under 2**24 nor out of order."""
  x = np.full(1 << 20, 32, np.int32)  # sums up to 2**25
  got = np.asarray(jax.jit(selection._prefix_sum)(x)).astype(np.int64)
  want = np.cumsum(x, dtype=np.int64)
  small = want < 2**24
  np.testing.assert_array_equal(got[small], want[small])
  assert np.all(got[~small] >= 2**24) and np.all(np.diff(got) >= 0)
  exact = jax.jit(lambda x: selection._prefix_sum(x, exact=True))(x)
  np.testing.assert_array_equal(np.asarray(exact), want)  # int32: exact below 2**31


def test_kth_largest_bits_matches_sort():
  x = np.abs(_normal(3000, 1))
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.int32)
  for k in (1, 17, 3000):
    got = jax.lax.bitcast_convert_type(selection._kth_largest_bits(bits, k), jnp.float32)
    assert float(got) == np.sort(x)[-k]


@pytest.mark.parametrize("ratio", [0.02, 0.2])
def test_sampled_topk_is_exact_top_k_when_the_count_fits(ratio):
  n, k = 65536, 400
  x = _normal(n, 3)
  select = jax.jit(lambda x, key: selection.sampled_topk(x, k, k, key, ratio))
  values, indices = select(jnp.asarray(x), jax.random.key(0))
  np.testing.assert_array_equal(np.sort(np.asarray(indices)), np.sort(harness.np_topk(x, k)))
  harness.assert_bitwise_equal(values, x[np.asarray(indices)])


def test_sampled_topk_unsampled_is_lax_top_k_without_a_loop_or_a_branch():
  """``Tuning(sampled=False)``: select_topk's payload bit for bit, k's tail emptied,
  and no ``while`` or ``conditional`` in the program (each a host round trip on GPU)."""
  n, capacity, k = 4096, 64, 50
  x = jnp.asarray(_normal(n, 5))
  unsampled = selection.Tuning(sampled=False)
  select = jax.jit(lambda x, key: selection.sampled_topk(x, capacity, k, key, 0.05, unsampled))
  got = select(x, jax.random.key(0))
  for a, b in zip(got, jax.jit(lambda x: selection.select_topk(x, capacity, k))(x)):
    harness.assert_bitwise_equal(a, b)
  assert int(np.sum(np.asarray(got[1]) != EMPTY)) == k
  control = harness.control_flow(select.lower(x, jax.random.key(0)).compile().as_text())
  assert not control, control
  # The foil: the sampled route in JAX has both.
  in_jax = selection.Tuning(native=False)
  sampled = jax.jit(lambda x, key: selection.sampled_topk(x, capacity, k, key, 0.05, in_jax))
  control = harness.control_flow(sampled.lower(x, jax.random.key(0)).compile().as_text())
  assert control["while"] and control["conditional"]


@pytest.mark.parametrize("n", [676, 4095])
def test_sampled_topk_below_its_min_size_is_lax_top_k(n):
  """Fewer than ``tuning.sampled_min_size`` entries: select_topk's payload bit for bit
  and no loop or branch; with no minimum, the threshold's loops and fallback."""
  capacity, k = 64, 50
  x = jnp.asarray(_normal(n, 6))
  small = jax.jit(lambda x, key: selection.sampled_topk(x, capacity, k, key, 0.25))
  got = small(x, jax.random.key(0))
  for a, b in zip(got, jax.jit(lambda x: selection.select_topk(x, capacity, k))(x)):
    harness.assert_bitwise_equal(a, b)
  assert not harness.control_flow(small.lower(x, jax.random.key(0)).compile().as_text())
  every_size = selection.Tuning(sampled_min_size=None, native=False)
  sampled = jax.jit(
      lambda x, key: selection.sampled_topk(x, capacity, k, key, 0.25, every_size))
  control = harness.control_flow(sampled.lower(x, jax.random.key(0)).compile().as_text())
  assert control["while"] and control["conditional"]
  _, indices = sampled(x, jax.random.key(0))
  np.testing.assert_array_equal(np.sort(np.asarray(indices)[:k]),
                                np.sort(harness.np_topk(np.asarray(x), k)))


def test_sampled_threshold_candidates_fit_the_capacity():
  """On Gaussian data the sampled path is taken: k <= count <= 2 k candidates."""
  n, k = 65536, 400
  x = _normal(n, 4)
  capacity = selection.candidate_capacity(n, k)
  assert capacity == selection.Tuning().candidate_factor * k
  find = jax.jit(lambda x, key: selection.threshold_candidates(x, k, key, 0.05, capacity))
  for seed in range(3):
    index, total = find(jnp.asarray(x), jax.random.key(seed))
    assert k <= int(total) <= capacity
    got = np.asarray(index)[:int(total)]
    cut = np.abs(x[got]).min()
    np.testing.assert_array_equal(got, np.nonzero(np.abs(x) >= cut)[0])
    assert np.all(np.asarray(index)[int(total):] == EMPTY)


def test_the_threshold_and_its_compaction_run_no_loop():
  """Steps 1 and 2 of the sampled selections are straight-line kernels: the sample's
  threshold from one top_k (not a radix search's loop), each compacted slot's word
  from a count (not a binary search's loop), and no branch."""
  n, k = 65536, 400
  find = jax.jit(lambda x, key: selection.threshold_candidates(
      x, k, key, 0.05, selection.candidate_capacity(n, k)))
  x = jnp.asarray(_normal(n, 4))
  text = find.lower(x, jax.random.key(0)).compile().as_text()
  assert not harness.control_flow(text), harness.control_flow(text)
  assert "top_k" in text or "TopK" in text  # the foil: the threshold comes from a top_k


def test_sampled_topk_falls_back_when_the_count_is_off():
  n, k = 4096, 40
  # Equal magnitudes: everything is above any threshold, far above the capacity.
  select = jax.jit(lambda x, key, ratio: selection.sampled_topk(x, k, k, key, ratio),
                   static_argnums=2)
  x = jnp.ones(n).at[100].set(3.0)
  _, indices = select(x, jax.random.key(0), 0.1)
  # The fallback's radix search gives the exact set in increasing index order.
  np.testing.assert_array_equal(np.asarray(indices), np.sort(harness.np_topk(np.asarray(x), k)))
  # A few large entries the sample misses: too few above the threshold.
  y = jnp.zeros(n).at[jnp.arange(0, 4 * k, 4)].set(jnp.arange(1, k + 1, dtype=jnp.float32))
  _, indices = select(y, jax.random.key(1), 0.01)
  np.testing.assert_array_equal(np.sort(np.asarray(indices)), np.arange(0, 4 * k, 4))


@pytest.mark.parametrize("ratio", [0.02, 1.0])
@pytest.mark.parametrize("equal", [False, True])
def test_sampled_topk_of_a_head_ignores_the_tail(ratio, equal):
  """``size=`` selects among ``x[:size]`` exactly as on the head alone, both branches."""
  n, k = 65536, 400
  head = np.ones(n, np.float32) if equal else _normal(n, 5)  # equal: the fallback branch
  tail = np.full(1000, 1e6, np.float32)  # would be chosen if the head's end were ignored
  whole = jnp.asarray(np.concatenate([head, tail]))
  key = jax.random.key(2)
  alone = jax.jit(lambda x: selection.sampled_topk(x, k, k, key, ratio))(jnp.asarray(head))
  in_place = jax.jit(
      lambda x: selection.sampled_topk(x, k, k, key, ratio, size=n))(whole)
  harness.assert_bitwise_equal(in_place, alone)
  assert int(np.max(np.asarray(in_place[1]))) < n


@pytest.mark.parametrize("size", [0, 4097, 2.5])
def test_sampled_topk_refuses_a_head_outside_x(size):
  with pytest.raises(ValueError, match=r"`size` must be an int in \[1, 4096\]"):
    selection.sampled_topk(jnp.ones(4096), 40, 40, jax.random.key(0), 0.1, size=size)


def test_sampled_topk_reads_its_tuning():
  """A candidate buffer too small for the count above the threshold: the exact fallback."""
  n, k = 65536, 400
  x = _normal(n, 3)
  narrow = selection.Tuning(candidate_factor=1, oversample=4.0)
  _, total = selection.threshold_candidates(
      jnp.asarray(x), k, jax.random.key(0), 0.05, selection.candidate_capacity(n, k, narrow),
      narrow)
  assert int(total) > selection.candidate_capacity(n, k, narrow)
  select = jax.jit(lambda x, key: selection.sampled_topk(x, k, k, key, 0.05, narrow))
  _, indices = select(jnp.asarray(x), jax.random.key(0))
  # The exact set: the candidates, cut to the buffer's first k in index order, are not.
  np.testing.assert_array_equal(np.asarray(indices), np.sort(harness.np_topk(x, k)))


# ------------------------------------------------------------------ exact_topk


@functools.lru_cache(maxsize=None)
def _exact_topk_fn(capacity, ratio):
  return jax.jit(lambda x, key: selection.exact_topk(x, capacity, key, ratio))


def _exact_topk(x, capacity, seed=0, ratio=None):
  return _exact_topk_fn(capacity, ratio)(jnp.asarray(x), jax.random.key(seed))


@pytest.mark.parametrize("n,k", [(65536, 400), (300_000, 300), (2**20, 1049)])
def test_exact_topk_takes_the_sampled_path_and_is_exact(n, k):
  x = _normal(n, n)
  candidates = selection.candidate_capacity(n, k)
  ratio = selection.exact_sample_ratio(n, k)
  _, total = jax.jit(selection.threshold_candidates, static_argnums=(1, 3, 4))(
      jnp.asarray(x), k, jax.random.key(0), ratio, candidates)
  assert k <= int(total) <= candidates  # the fast branch, not the fallback
  values, indices = _exact_topk(x, k)
  _assert_same_as_lax_top_k(x, k, values, indices)


def test_exact_topk_falls_back_and_is_still_exact():
  n, k = 4096, 40
  # Equal magnitudes: far more candidates than the buffer holds.
  x = np.ones(n, np.float32)
  x[[7, 100, 2000]] = [-3.0, 3.0, 2.0]
  _assert_same_as_lax_top_k(x, k, *_exact_topk(x, k, ratio=0.1))
  # A few large entries the sample misses: fewer candidates than k.
  y = np.zeros(n, np.float32)
  y[np.arange(0, 4 * k, 4)] = np.arange(1, k + 1)
  _assert_same_as_lax_top_k(y, k, *_exact_topk(y, k, seed=1, ratio=0.01))


def _nan_as_inf_topk(x, k):
  """The positions of the k largest magnitudes, NaN ranked as inf, ties to the lower
  index (``harness.np_topk``), in index order."""
  return np.sort(harness.np_topk(np.where(np.isnan(x), np.inf, x), k))


@functools.lru_cache(maxsize=None)
def _radix_fn(capacity, size):
  return jax.jit(lambda x, k: selection._topk_by_radix(x, capacity, k, size))


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**16), levels=st.sampled_from([2, 50, None]),
                  k=st.integers(0, 40), size=st.sampled_from([1000, 1003]),
                  bad=st.sampled_from([None, np.nan, -np.inf, "largest nan", "nan and inf"]))
def test_the_radix_fallback_is_the_k_largest_magnitudes_of_the_head(seed, levels, k, size,
                                                                     bad):
  """Any k up to the capacity, of a head of ``x``, ties to the lower index (few
  magnitudes: many ties at the cut), NaN ranked as inf (a NaN of the largest bits
  too, and NaN tied with inf at the cut); in index order, the slots past k empty."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=1003).astype(np.float32)
  if levels is not None:
    x = (np.round(x * levels) / levels).astype(np.float32)
  if bad == "largest nan":  # magnitude bits 0x7fffffff, more of them than k
    x[rng.choice(1003, 50, replace=False)] = np.int32(-1).view(np.float32)
  elif bad == "nan and inf":  # more of them than k: their ties decide the set
    x[rng.choice(1003, 25, replace=False)] = np.nan
    x[rng.choice(1003, 25, replace=False)] = -np.inf
  elif bad is not None:
    x[rng.choice(1003, 3, replace=False)] = bad
  values, indices = _radix_fn(40, size)(jnp.asarray(x), k)
  want = _nan_as_inf_topk(x[:size], k)
  np.testing.assert_array_equal(np.asarray(indices)[:k], want)
  assert np.all(np.asarray(indices)[k:] == EMPTY)
  harness.assert_bitwise_equal(values, np.concatenate([x[want], np.zeros(40 - k, np.float32)]))


@pytest.mark.parametrize("route", ["exact_topk", "sampled_topk"])
def test_the_fallback_makes_no_buffer_the_size_of_x(route):
  """``lax.top_k`` of the magnitudes would write them out first: on XLA:CPU memory of
  its own in every step's allocation, taken or not, which then kept the mean's
  zeros out of the corrected gradient's."""
  n, k = 1 << 22, 4195
  select = {
      "exact_topk": lambda x: selection.exact_topk(x, k),
      "sampled_topk": lambda x: selection.sampled_topk(x, k, k, jax.random.key(0), 0.01),
  }[route]
  memory = jax.jit(select).lower(jax.ShapeDtypeStruct((n,), jnp.float32)).compile().memory_analysis()
  if memory is None:
    pytest.skip("this backend reports no memory analysis")
  assert memory.temp_size_in_bytes < 2 * n  # half of x's 4n bytes


def test_exact_topk_orders_nan_and_infinities_as_lax_top_k():
  n, k = 8192, 64
  x = _normal(n, 5)
  x[[3, 900]] = np.inf
  x[[17, 4000]] = -np.inf
  x[[50, 5000]] = np.nan
  x[6000] = -np.nan
  x[[60, 61, 62]] = np.float32(5.0)  # ties at the cut are not the issue here
  _assert_same_as_lax_top_k(x, k, *_exact_topk(x, k, ratio=0.05))
  # Ties at the cut: the lower indices win, as in lax.top_k.
  z = np.zeros(n, np.float32)
  z[::3] = 1.0
  z[[10, 11]] = -2.0
  _assert_same_as_lax_top_k(z, k, *_exact_topk(z, k, ratio=0.05))


@pytest.mark.parametrize("route", ["exact_topk", "sampled_topk"])
def test_both_branches_rank_nan_as_inf_ties_to_the_lower_index(route):
  """More NaN and infinities than k: the set is decided by their ties. The fast branch
  (the sample's threshold is inf's, and about 1.5 k lie at or above it) and the radix
  fallback (a candidate buffer too narrow) give the same set."""
  n, k = 8192, 64
  rng = np.random.default_rng(9)
  x = _normal(n, 9)
  x[rng.choice(n, 48, replace=False)] = np.nan
  x[rng.choice(n, 48, replace=False)] = -np.inf
  want = _nan_as_inf_topk(x, k)
  wide, narrow = selection.Tuning(), selection.Tuning(candidate_factor=1)
  taken = set()
  for tuning in (wide, narrow):
    candidates = selection.candidate_capacity(n, k, tuning)
    _, total = selection.threshold_candidates(jnp.asarray(x), k, jax.random.key(0), 0.25,
                                              candidates, tuning)
    taken.add("fast" if k <= int(total) <= candidates else "fallback")
    select = {
        "exact_topk": lambda x, t=tuning: selection.exact_topk(x, k, jax.random.key(0), 0.25, t),
        "sampled_topk": lambda x, t=tuning: selection.sampled_topk(
            x, k, k, jax.random.key(0), 0.25, t),
    }[route]
    values, indices = jax.jit(select)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(indices), want)
    harness.assert_bitwise_equal(values, x[want])
  assert taken == {"fast", "fallback"}


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("equal", [False, True])  # equal magnitudes: the fallback branch
def test_exact_topk_fills_k_of_its_slots(traced, equal):
  """The top k in the first k of ``capacity`` slots, index order; the rest empty."""
  n, capacity, k = 8192, 64, 40
  x = np.ones(n, np.float32) if equal else _normal(n, 6)
  if equal:
    x[[5, 700, 7000]] = 3.0
  select = jax.jit(lambda x, k: selection.exact_topk(x, capacity, k=k),
                   static_argnums=() if traced else 1)
  values, indices = select(jnp.asarray(x), k)
  _assert_same_as_lax_top_k(x, k, values[:k], indices[:k])
  assert np.all(np.asarray(indices[k:]) == EMPTY) and not np.any(np.asarray(values[k:]))


def test_shared_length_pads_on_the_exact_route_in_jax_only(monkeypatch):
  cpu, gpu = selection.tuning_for("cpu")._replace(native=False), selection.tuning_for("gpu")
  big = cpu.exact_min_size
  assert selection.shared_length(big + 1, 1000, cpu) == -(-(big + 1) // 1000) * 1000
  assert selection.shared_length(big - 1, 1000, cpu) == big - 1  # lax.top_k's route
  assert selection.shared_length(big + 1, 1000, gpu) == big + 1
  small = selection.Tuning(exact_min_size=2000, native=False)
  assert selection.shared_length(3000, 1000, small) == 3000
  # The native custom call compiles nothing per shape: no padding where it runs.
  monkeypatch.setattr(selection.native, "available", lambda: True)
  assert selection.shared_length(big + 1, 1000, cpu._replace(native=True)) == big + 1


def test_exact_topk_of_everything_is_every_index():
  x = _normal(100, 6)
  values, indices = jax.jit(lambda x: selection.exact_topk(x, 100))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(indices), np.arange(100))
  harness.assert_bitwise_equal(values, x)


# Sizes and ratios from small fixed sets: each (n, k, ratio) is one compile.
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    n=st.sampled_from([97, 5000]),
    density=st.sampled_from([0.001, 0.1, 0.5]),
    levels=st.sampled_from([3, 50, None]),
    seed=st.integers(0, 2**16),
    ratio=st.sampled_from([0.01, 0.5]),
)
def test_exact_topk_matches_lax_top_k(n, density, levels, seed, ratio):
  """Any data (few distinct magnitudes: many ties), any sample: the set of lax.top_k."""
  rng = np.random.default_rng(seed)
  if levels is None:
    x = rng.normal(size=n).astype(np.float32)
  else:
    x = (rng.integers(-levels, levels + 1, size=n) / levels).astype(np.float32)
  k = max(1, math.ceil(density * n))
  _assert_same_as_lax_top_k(x, k, *_exact_topk(x, k, seed=seed, ratio=ratio))


# ------------------------------------------------------------------ non-finite entries


# Compiled once per route, the sample's key an argument: every example runs one program.
_CAPACITY = 64
_ROUTES = {
    "select_topk": jax.jit(lambda x, key: selection.select_topk(x, _CAPACITY)),
    "exact_topk": jax.jit(lambda x, key: selection.exact_topk(x, _CAPACITY)),
    "sampled_topk": jax.jit(
        lambda x, key: selection.sampled_topk(x, _CAPACITY, _CAPACITY, key, 0.05)),
}


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    bad=st.sampled_from([np.nan, -np.nan, np.inf, -np.inf]),
    count=st.sampled_from([1, 3, 400]), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("route", list(_ROUTES))
def test_a_non_finite_entry_is_always_selected(route, bad, count, seed):
  """What ``payload_carries_nonfinite`` rests on for top-k, gTop-k and DGC:
  NaN and Inf rank above every finite magnitude, so a non-finite bucket
  always sends one (more of them than slots too)."""
  n = 8192
  x = _normal(n, seed) * np.float32(1e30)
  x[np.random.default_rng(seed).choice(n, count, replace=False)] = bad
  values, _ = _ROUTES[route](jnp.asarray(x), jax.random.key(seed))
  assert not np.isfinite(np.asarray(values)).all()


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    bad=st.sampled_from([np.nan, -np.nan, np.inf, -np.inf]),
    count=st.sampled_from([1, 3, 400]), seed=st.integers(0, 2**16), k=st.sampled_from([1, 2]))
def test_a_non_finite_entry_is_always_selected_in_its_row(bad, count, seed, k):
  """What ``payload_carries_nonfinite`` rests on for DeMo and SparseLoCo: each
  chunk that holds NaN or Inf sends one, and a finite chunk sends only finite values."""
  rows, chunk = 64, 128
  x = _normal(rows * chunk, seed) * np.float32(1e30)
  x[np.random.default_rng(seed).choice(x.size, count, replace=False)] = bad
  x = x.reshape(rows, chunk)
  values, positions = jax.jit(lambda x: selection.topk_per_row(x, k))(jnp.asarray(x))
  bad_rows = ~np.isfinite(x).all(axis=1)
  np.testing.assert_array_equal(~np.isfinite(np.asarray(values)).all(axis=1), bad_rows)
  np.testing.assert_array_equal(np.asarray(values),
                                np.take_along_axis(x, np.asarray(positions), axis=1))


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**16), bad=st.sampled_from([np.nan, -np.nan, np.inf, -np.inf]),
                  k=st.sampled_from([1, 2, 3, 5]), width=st.sampled_from([64, 96, 256, 1024]),
                  row_block=st.sampled_from([32, 8, 16, None]), argmax_k=st.sampled_from([1, 3, 8]))
def test_every_route_per_row_is_top_k_order(seed, bad, k, width, row_block, argmax_k):
  """Each route of ``topk_per_row`` (the blocks of ``row_block`` entries where a row
  holds at least ``4 k`` of them, ``k`` argmax reductions up to ``argmax_k``,
  ``lax.top_k``) keeps ``top_k``'s order: largest first, the lowest position among
  ties, NaN ranked as inf. Entries in {-2, ..., 2} tie in every row; -0 ties with 0,
  NaN with inf."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-2, 3, size=(40, width)).astype(np.float32)
  x[rng.integers(0, 40, 12), rng.integers(0, width, 12)] = bad
  x[rng.integers(0, 40, 12), rng.integers(0, width, 12)] = -np.inf  # ties with NaN
  x[0] = -0.0
  x[1] = np.float32(1e-40) * rng.integers(-2, 3, size=width)  # subnormals
  tuning = selection.Tuning(row_block=row_block, argmax_k=argmax_k)
  values, positions = jax.jit(lambda x: selection.topk_per_row(x, k, tuning))(jnp.asarray(x))
  magnitude = np.abs(x)
  magnitude[np.isnan(magnitude)] = np.inf
  want = np.argsort(-magnitude, axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(np.asarray(positions), want)
  harness.assert_bitwise_equal(np.asarray(values), np.take_along_axis(x, want, axis=1))


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**16), rows=st.integers(1, 90),
                  block=st.sampled_from([3, 4, 7]), k=st.sampled_from([1, 2, 5]))
def test_a_product_selected_block_by_block_is_the_whole_product_s_selection(seed, rows, block,
                                                                          k):
  """``topk_per_row_of_product`` in blocks of ``product_rows`` rows (from 8 blocks on,
  the last block overlapping the one before) selects what ``topk_per_row`` of the
  whole product selects: a row's product does not depend on the rows beside it.
  Small integers, so that every product is exact whatever order it sums in (the same
  bits on any CPU), and ties in every row; NaN and inf in some. Below 8 blocks' rows
  the program holds no loop."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-3, 4, size=(rows, 24)).astype(np.float32)
  x[rng.integers(0, rows, 3), rng.integers(0, 24, 3)] = np.nan
  x[rng.integers(0, rows, 3), rng.integers(0, 24, 3)] = np.inf
  matrix = rng.integers(-2, 3, size=(24, 16)).astype(np.float32)
  whole = selection.Tuning(product_rows=None)
  by_blocks = selection.Tuning(product_rows=block)
  select = lambda tuning: jax.jit(  # noqa: E731
      lambda x, m: selection.topk_per_row_of_product(x, m, k, tuning))
  want = select(whole)(x, matrix)
  got = select(by_blocks)(x, matrix)
  for g, w in zip(got, want):
    harness.assert_bitwise_equal(np.asarray(g), np.asarray(w))
  loops = harness.control_flow(select(by_blocks).lower(x, matrix).compile().as_text())
  assert loops["while"] == (1 if rows >= 8 * block else 0)


def test_a_product_by_blocks_has_the_whole_product_s_dtype():
  rows = jnp.arange(40 * 8, dtype=jnp.bfloat16).reshape(40, 8) % 5
  matrix = jnp.eye(8, dtype=jnp.float32)
  tuning = selection.Tuning(product_rows=4)
  values, positions = selection.topk_per_row_of_product(rows, matrix, 2, tuning)
  want_values, want_positions = selection.topk_per_row(rows @ matrix, 2, tuning)
  assert values.dtype == want_values.dtype == jnp.float32
  harness.assert_bitwise_equal(np.asarray(values), np.asarray(want_values))
  np.testing.assert_array_equal(np.asarray(positions), np.asarray(want_positions))


def test_product_rows_is_refused_by_name():
  with pytest.raises(ValueError, match="`tuning.product_rows` must be None or an int >= 1"):
    selection.topk_per_row_of_product(jnp.zeros((3, 4)), jnp.zeros((4, 4)), 1,
                                      selection.Tuning(product_rows=0))


@pytest.mark.parametrize("k, tuning, message", [
    (0, {}, "`k` must be an int in \\[1, 64\\]"), (65, {}, "`k` must be an int in"),
    (2.0, {}, "`k` must be an int in"),
    (2, {"row_block": 0}, "`tuning.row_block` must be None or an int >= 1"),
    (2, {"argmax_k": 0}, "`tuning.argmax_k` must be an int >= 1"),
    (2, {"argmax_k": None}, "`tuning.argmax_k` must be an int >= 1"),
])
def test_per_row_arguments_are_refused_by_name(k, tuning, message):
  with pytest.raises(ValueError, match=message):
    selection.topk_per_row(jnp.zeros((3, 64)), k, selection.Tuning(**tuning))


@pytest.mark.parametrize("k, width, row_block, argmax_k, top_k_widths, argmaxes", [
    (5, 4096, 32, 8, [128, 160], 0),  # by blocks: the maxima of 128 blocks, then 5 blocks' entries
    (5, 4096, None, 1, [4096], 0),    # a GPU's or TPU's route
    (5, 4096, None, 8, [], 5),        # five argmaxes
    (40, 4096, 32, 8, [4096], 0),     # 40 blocks of 128 would be more than a quarter of the row
    (5, 4100, 32, 8, [], 5),          # blocks do not tile the row: argmaxes
    (9, 4100, 32, 8, [4100], 0),      # nor would argmaxes pay
    (2, 64, 32, 8, [], 2),            # DeMo's rows
    (1, 4096, 32, 1, [], 1),          # one reduction, on every backend
])
def test_per_row_route_follows_the_tuning(k, width, row_block, argmax_k, top_k_widths,
                                          argmaxes):
  """The route taken in JAX, read off the program: the widths of its ``top_k``s and
  its argmax reductions (where the native custom call runs, it takes the blocks'
  place: ``test_native``)."""
  tuning = selection.Tuning(row_block=row_block, argmax_k=argmax_k, native=False)
  jaxpr = jax.make_jaxpr(lambda x: selection.topk_per_row(x, k, tuning))(
      jnp.zeros((6, width), jnp.float32))
  widths = [eqn.invars[0].aval.shape[-1] for eqn in jaxpr.jaxpr.eqns
            if eqn.primitive.name == "top_k"]
  assert widths == top_k_widths
  assert sum(eqn.primitive.name == "argmax" for eqn in jaxpr.jaxpr.eqns) == argmaxes


# ---------------------------------------------------------------- max_magnitude


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**16), width=st.sampled_from([1, 7, 32, 33, 64, 100, 1100]),
                  bad=st.sampled_from([np.nan, -np.nan, np.inf, -np.inf, None]))
def test_max_magnitude_is_each_rows_largest_magnitude_nan_as_inf(seed, width, bad):
  """Exact for rows of any width (pieces of 32, the last one padded), -0 and
  subnormals included; a row with NaN or an infinity gives inf."""
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(9, width)) * 10.0 ** rng.integers(-40, 38, size=(9, 1))).astype(np.float32)
  x[0] = -0.0
  x[1] = np.float32(1e-40) * rng.integers(-2, 3, size=width)
  if bad is not None:
    x[rng.integers(2, 9, 3), rng.integers(0, width, 3)] = bad
  want = np.abs(x)
  want[np.isnan(want)] = np.inf
  harness.assert_bitwise_equal(np.asarray(jax.jit(selection.max_magnitude)(jnp.asarray(x))),
                               want.max(axis=1))


def test_max_magnitude_reads_its_rows_once():
  """On XLA:CPU the reduction fuses with what computes its rows: a program that
  adds two vectors and takes the largest magnitude of every 64 entries reads them
  and writes almost nothing (``max(where(isnan(x), inf, |x|))`` over rows of 64
  is split into a tree whose first level writes and reads the rows again: 4 passes)."""
  n = 1 << 18
  x = jnp.zeros((n,), jnp.float32)
  text = jax.jit(lambda x, r: selection.max_magnitude((x + r).reshape(-1, 64))).lower(
      x, x).compile().as_text()
  counts = hlo_counts.count(text, n)
  assert counts.passes < 2.1, counts.heaviest
