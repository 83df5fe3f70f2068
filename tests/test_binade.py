"""binade.unit_factor: the exact power of two that brings a value into [1, 2)."""

import hypothesis
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np

from jaxcomp._src import binade


@hypothesis.given(st.floats(2.0**-126, float(np.finfo(np.float32).max), width=32),
                  st.sampled_from([1.0, -1.0]))
def test_a_normal_value_lands_in_one_to_two_or_the_top_binade_in_two_to_four(value, sign):
  top = np.float32(sign * value)
  factor = np.float32(binade.unit_factor(jnp.asarray(top)))
  mantissa, _ = np.frexp(factor)
  assert mantissa == 0.5  # a power of two: the product is exact
  scaled = float(np.abs(top)) * float(factor)
  if np.abs(top) >= 2.0**127:
    assert 2.0 <= scaled < 4.0
  else:
    assert 1.0 <= scaled < 2.0


def test_zero_and_non_finite_values():
  got = np.asarray(binade.unit_factor(jnp.asarray([0.0, -0.0, np.inf, -np.inf, np.nan],
                                                  jnp.float32)))
  np.testing.assert_array_equal(got, np.float32([2.0**127, 2.0**127, 2.0**-126, 2.0**-126,
                                                 2.0**-126]))
  assert np.isnan(np.float32(np.nan) * got[-1]) and np.isinf(np.float32(np.inf) * got[2])


def test_unit_norm_gives_the_norm_where_the_squares_overflow():
  rows = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
  for scale in (1.0, 1e30):
    x = rows * np.float32(scale)
    f, norm = binade.unit_norm(jnp.asarray(x), axis=1)
    want = np.linalg.norm(x.astype(np.float64), axis=1)
    np.testing.assert_allclose(np.float64(norm) / np.float64(f), want, rtol=1e-6)
    f, norm = binade.unit_norm(jnp.asarray(x))
    np.testing.assert_allclose(float(norm) / float(f), np.linalg.norm(x.astype(np.float64)),
                               rtol=1e-6)
