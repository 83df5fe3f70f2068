"""Counter-based draws: in range, spread evenly, a pure function of the key."""

import jax
import numpy as np
import pytest

from jaxcomp._src import draws


@pytest.mark.parametrize("high", [1, 7, 1000, 2**31])
def test_integers_lie_in_range_and_spread_evenly(high):
  got = np.asarray(draws.integers(jax.random.key(3), 200_000, high))
  assert got.dtype == np.int32 and got.min() >= 0 and got.max() < high
  if high == 7:  # every value about 1/7 of the draws (binomial sd about 0.2%)
    counts = np.bincount(got, minlength=7) / got.size
    np.testing.assert_allclose(counts, 1 / 7, atol=0.005)
  if high == 2**31:  # the top half reached as often as the bottom
    assert abs((got >= 2**30).mean() - 0.5) < 0.005


def test_uniform_is_in_unit_interval_with_mean_one_half():
  got = np.asarray(draws.uniform(jax.random.key(0), 100_000))
  assert got.min() >= 0 and got.max() < 1
  assert abs(got.mean() - 0.5) < 0.005


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_fills_bins_evenly_and_neighbours_are_unrelated(seed):
  """Consecutive counters are what a weak hash betrays: 64 bins, then the 16 x 16 bins
  of (u_i, u_{i+1}), each within a chi-square bound (p about 1e-4), and the lag-1
  and lag-2 correlations within 5 standard deviations."""
  n = 1 << 20
  got = np.asarray(draws.uniform(jax.random.key(seed), n, seed))

  def chi_square(counts):
    expected = counts.sum() / counts.size
    return ((counts - expected) ** 2 / expected).sum()

  single = np.bincount((got * 64).astype(int), minlength=64)
  assert chi_square(single) < 63 + 5 * np.sqrt(2 * 63), single
  pairs = (got[:-1] * 16).astype(int) * 16 + (got[1:] * 16).astype(int)
  assert chi_square(np.bincount(pairs, minlength=256)) < 255 + 5 * np.sqrt(2 * 255)
  for lag in (1, 2):
    assert abs(np.corrcoef(got[:-lag], got[lag:])[0, 1]) < 5 / np.sqrt(n)


def test_a_draw_depends_on_the_key_and_the_stream_only():
  a = draws.bits(jax.random.key(1), 64)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(draws.bits(jax.random.key(1), 64)))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(draws.bits(jax.random.key(1), 64, 0)))
  assert (np.asarray(a) != np.asarray(draws.bits(jax.random.key(2), 64))).mean() > 0.9
  for stream in (1, 2, 2**31 - 1):
    assert (np.asarray(a) != np.asarray(draws.bits(jax.random.key(1), 64, stream))).mean() > 0.9


def test_streams_are_uncorrelated_and_a_zero_key_draws_no_zeros():
  key = jax.random.wrap_key_data(np.zeros(2, np.uint32))
  first, second = (np.asarray(draws.uniform(key, 100_000, s)) for s in (0, 1))
  assert abs(np.corrcoef(first, second)[0, 1]) < 0.02  # sd of r about 0.003
  assert (np.asarray(draws.bits(key, 16)) != 0).all()


@pytest.mark.parametrize("draw", [
    lambda key: draws.uniform(key, 1000, 3),
    lambda key: jax.random.key_data(draws.step_keys(draws.derive(key, 5))[1])])
def test_a_draw_and_a_key_split_compile_without_a_loop(draw):
  """No threefry: no ``while`` (its rounds' loop on CPU) in the compiled program."""
  text = jax.jit(draw).lower(jax.random.key(0)).compile().as_text()
  assert " while(" not in text and "threefry" not in text


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_step_keys_chain_distinct_keys_of_the_same_implementation(impl):
  key, seen = jax.random.key(0, impl=impl), set()
  step_keys = jax.jit(draws.step_keys)
  for _ in range(500):
    key, draw = step_keys(key)
    assert jax.random.key_impl(draw) == jax.random.key_impl(key)
    for k in (key, draw):
      seen.add(np.asarray(jax.random.key_data(k)).tobytes())
  assert len(seen) == 1000
  a, b = (np.asarray(jax.random.key_data(draws.derive(key, s))) for s in (0, 1))
  assert a.shape == b.shape == np.asarray(jax.random.key_data(key)).shape
  assert (a != b).all()


@pytest.mark.parametrize("high", [0, 2**31 + 1])
def test_a_range_out_of_bounds_is_refused(high):
  with pytest.raises(ValueError, match="`high`"):
    draws.integers(jax.random.key(0), 4, high)
