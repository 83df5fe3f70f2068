"""QSGD against a numpy oracle of its rule, and its statistics (8 fake CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import stochastic_quantization
from jaxcomp import training
from jaxcomp import wire

LEVELS = 4
BUCKET = 16
PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5,))}  # 53 elements: a partial last bucket


def _oracle(corrected, draws, levels, bucket):
  """numpy QSGD of one device: ``(levels [m * bucket], norms [m])`` from its uniform draws."""
  n = corrected.shape[0]
  blocks = -(-n // bucket)
  x = np.zeros(blocks * bucket, np.float64)
  x[:n] = corrected
  x = x.reshape(blocks, bucket)
  norms = np.sqrt((x * x).sum(axis=1))
  scaled = levels * np.abs(x) / np.where(norms == 0, 1, norms)[:, None]
  floor = np.floor(scaled)
  level = np.minimum(floor + (draws.reshape(blocks, bucket) < scaled - floor), levels)
  return (np.sign(x) * level).reshape(-1), norms


def _draws(seed, device, size):
  """The uniform draws of device ``device`` at the first step (the documented key rule)."""
  _, draw = jax.random.split(jax.random.wrap_key_data(jaxcomp.base.raw_key(seed)))
  return np.asarray(jax.random.uniform(jax.random.fold_in(draw, device), (size,)))


@pytest.mark.parametrize("error_feedback", [False, True])
def test_mean_and_residual_equal_the_numpy_oracle(error_feedback):
  mesh = training.make_mesh(8)
  tx = jaxcomp.qsgd(LEVELS, "data", bucket_size=BUCKET, error_feedback=error_feedback, seed=5)
  state = training.init_state(tx, PARAMS, mesh, "data")
  rng = np.random.default_rng(0)
  grads = {"w": rng.normal(size=(8, 8, 6)).astype(np.float32),
           "b": rng.normal(size=(8, 5)).astype(np.float32)}
  out, new_state = jax.block_until_ready(training.make_update(tx, mesh, "data")(
      training.shard(grads, mesh, "data"), state))
  n = 53
  blocks = -(-n // BUCKET)
  mean = np.zeros(n)
  for device in range(8):
    corrected = np.concatenate([grads["b"][device], grads["w"][device].reshape(-1)])
    levels, norms = _oracle(corrected, _draws(5, device, blocks * BUCKET), LEVELS, BUCKET)
    decoded = (np.repeat(norms, BUCKET) / LEVELS * levels)[:n]
    mean += decoded / 8
    if error_feedback:
      residual = np.concatenate([np.asarray(new_state.residual["b"][device]),
                                 np.asarray(new_state.residual["w"][device]).reshape(-1)])
      np.testing.assert_allclose(residual, corrected - decoded, rtol=1e-5, atol=1e-6)
  got = np.concatenate([np.asarray(out["b"][0]), np.asarray(out["w"][0]).reshape(-1)])
  np.testing.assert_allclose(got, mean, rtol=1e-5, atol=1e-6)
  if not error_feedback:
    assert new_state.residual == ()


def test_quantization_is_unbiased_and_within_one_level():
  x = jnp.asarray(np.random.default_rng(1).normal(size=40).astype(np.float32))
  keys = jax.random.split(jax.random.key(0), 4000)
  levels, norms = jax.vmap(lambda k: stochastic_quantization.quantize(x, LEVELS, BUCKET, k))(keys)
  decoded = np.asarray(jnp.repeat(norms, BUCKET, axis=1) / LEVELS * levels)[:, :40]
  assert np.abs(np.asarray(levels)).max() <= LEVELS
  norm = np.asarray(norms)[0]
  step = np.repeat(norm, BUCKET)[:40] / LEVELS
  assert (np.abs(decoded - np.asarray(x)) <= step + 1e-6).all()
  spread = step / np.sqrt(len(keys))  # the rounding's standard error, at most
  assert (np.abs(decoded.mean(axis=0) - np.asarray(x)) <= 5 * spread + 1e-6).all()


def test_rounding_noise_differs_per_device_and_per_step():
  mesh = training.make_mesh(8)
  tx = jaxcomp.qsgd(1, "data", bucket_size=BUCKET)
  state = training.init_state(tx, PARAMS, mesh, "data")
  same = jax.tree.map(lambda x: np.ones((8,) + x.shape, np.float32), PARAMS)
  update = training.make_update(tx, mesh, "data")
  seen = []
  for _ in range(2):
    out, state = jax.block_until_ready(update(training.shard(same, mesh, "data"), state))
    seen.append(np.asarray(out["w"][0]))
  # One level with equal inputs: each device rounds each entry up or down at
  # random; identical draws on every device would give only 0 or the norm.
  assert len(np.unique(seen[0])) > 2
  assert not np.array_equal(seen[0], seen[1])


def test_bucket_larger_than_the_gradient_sends_no_padding():
  tx = jaxcomp.qsgd(8, "data", bucket_size=4096)
  got = wire.expected_bytes(tx, PARAMS, 8)
  assert got.total == 7 * (53 + 4)  # 53 int8 levels and one f32 norm from each device


@pytest.mark.parametrize("kwargs,error", [
    ({"levels": 0}, ValueError), ({"levels": 128}, ValueError), ({"levels": 2.5}, TypeError),
    ({"levels": 4, "bucket_size": 0}, ValueError), ({"levels": 4, "error_feedback": 1}, TypeError),
])
def test_bad_arguments(kwargs, error):
  with pytest.raises(error, match=next(iter(k for k in kwargs if k != "levels"), "levels")):
    jaxcomp.qsgd(axis_name="data", **kwargs)
