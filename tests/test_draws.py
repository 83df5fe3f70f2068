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


def test_a_draw_compiles_without_a_loop():
  """No threefry: no ``while`` (its rounds' loop on CPU) in the compiled draw."""
  text = jax.jit(lambda key: draws.uniform(key, 1000, 3)).lower(
      jax.random.key(0)).compile().as_text()
  assert " while(" not in text and "threefry" not in text


@pytest.mark.parametrize("high", [0, 2**31 + 1])
def test_a_range_out_of_bounds_is_refused(high):
  with pytest.raises(ValueError, match="`high`"):
    draws.integers(jax.random.key(0), 4, high)
