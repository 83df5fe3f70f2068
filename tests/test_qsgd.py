"""QSGD against a numpy oracle of its rule, and its statistics (8 fake CPU devices)."""

from unittest import mock

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from experiments import hlo_counts
from jaxcomp._src import draws
from jaxcomp._src import qsgd
from jaxcomp._src import quantized
from jaxcomp._src import selection
from jaxcomp import training
from jaxcomp import wire

import harness

LEVELS = 4
BUCKET = 16
PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5,))}  # 53 elements: a partial last bucket


# How close a draw may come to its rounding threshold ``scaled - floor(scaled)``
# in the oracle's data. XLA sums a bucket's squares for its norm in an order it
# picks per CPU, which moves ``scaled`` (at most ``LEVELS``) by a few ulps, about
# 1e-6: a draw closer than that could round the other way than the oracle's.
_MARGIN = 1e-4
SEED = 6  # a seed whose draws all keep the margin


def _quantize(x, draws, levels, block):
  """numpy QSGD of a flat f32 ``x`` (a multiple of ``block``): its decoded values."""
  x = x.reshape(-1, block).astype(np.float32)
  norms = np.sqrt((x * x).sum(axis=1, dtype=np.float32))
  scaled = np.float32(levels) * (np.abs(x) / np.where(norms == 0, 1, norms)[:, None])
  floor = np.floor(scaled)
  draws = draws.reshape(x.shape)
  # Every stochastic rounding of these data is decided far from its threshold.
  assert np.abs(draws - (scaled - floor))[x != 0].min() > _MARGIN
  level = np.minimum(floor + (draws < scaled - floor), levels)
  return (norms[:, None] / np.float32(levels) * np.sign(x) * level).reshape(-1)


def _uniform(seed, device, hop, n):
  """The rounding draws of ``device``'s hop at the first step (the documented rule)."""
  (draw,), _ = harness.step_draw_keys(seed, 1)
  return np.asarray(draws.uniform(draw, n, 2 * device + hop))


@pytest.fixture(params=harness.NATIVE_ROUTES, ids=["native", "xla"])
def route(request, monkeypatch):
  """Both routes of the norms: the custom call's and JAX's (five kernels and a branch)."""
  monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(native=request.param))
  return request.param


@pytest.mark.parametrize("magnitude", [1e-15, 1.0, 1e30, 4e37])
def test_levels_round_the_share_of_the_norm_at_any_scale(magnitude, route):
  """``s |x_i| / ||x_b||``, rounded down or up, at any scale whose norm fits in f32: at
  4e37, ``s |x_i|`` overflows and the norm's reciprocal (below ``2**-126``) flushes to
  zero, so neither may be formed."""
  levels, block = 127, 64
  rng = np.random.default_rng(0)
  x = (rng.uniform(0.5, 1.0, 4 * block) * rng.choice([-1.0, 1.0], 4 * block)
       * magnitude).astype(np.float32)
  level, norms = jax.jit(lambda x: qsgd.quantize(x, levels, block, jax.random.key(0)))(x)
  norms = np.asarray(norms, np.float64)
  want = np.sqrt((x.astype(np.float64).reshape(-1, block) ** 2).sum(axis=1))
  np.testing.assert_allclose(norms, want, rtol=1e-5)
  share = (levels * np.abs(x.astype(np.float64)).reshape(-1, block) / norms[:, None]).reshape(-1)
  got = np.asarray(level).astype(np.int64)
  # Rounded down or up, allowing the f32 quotient a few ulps at an integer.
  assert (np.abs(got) >= np.floor(share - 1e-4)).all() and (
      np.abs(got) <= np.floor(share + 1e-4) + 1).all()
  assert (np.sign(got[got != 0]) == np.sign(x[got != 0])).all()


@pytest.mark.parametrize("overflowing", [0, 3, 6])
def test_one_block_whose_squares_overflow_takes_every_norm_to_the_scaled_route(
    overflowing, route):
  """One block of entries near 4e37 (its squares overflow) among blocks of ordinary
  entries, wherever it lies: every norm is right, the large one not ``inf``."""
  block = 64
  x = np.random.default_rng(1).normal(size=(7, block)).astype(np.float32)
  x[overflowing] = np.float32(4e37) * np.sign(x[overflowing])
  norms = np.asarray(jax.jit(qsgd._norms)(x)[0], np.float64)
  np.testing.assert_allclose(norms, np.sqrt((x.astype(np.float64) ** 2).sum(axis=1)),
                             rtol=1e-5)


def test_gradients_near_the_largest_norm_give_their_mean(route):
  """Entries of 4e37 in blocks of 64 (norm 3.2e38, just inside f32): the mean is the
  gradient within QSGD's rounding, on both hops, not an overflowed level nor a zero
  from a flushed reciprocal."""
  mesh = training.make_mesh(8)
  tx = jaxcomp.qsgd(127, "data", bucket_size=64)
  params = {"w": jnp.zeros((8, 64))}
  state = training.init_state(tx, params, mesh, "data")
  grads = {"w": jnp.full((8, 8, 64), 4e37, jnp.float32)}
  out, _ = jax.block_until_ready(training.make_update(tx, mesh, "data")(
      training.shard(grads, mesh, "data"), state))
  np.testing.assert_allclose(np.asarray(out["w"], np.float64), 4e37, rtol=0.15)


def test_a_block_whose_norm_exceeds_f32_decodes_non_finite(route):
  """No f32 norm carries a block of 64 entries of 1e38 (norm 8e38): it decodes to
  non-finite values, so the step is dropped, never to zeros."""
  x = jnp.full((128,), 1e38, jnp.float32)
  level, norms = jax.jit(lambda x: qsgd.quantize(x, 127, 64, jax.random.key(0)))(x)
  codec = qsgd._codec(127, 64, jax.random.key(0), 0)
  decoded = jax.jit(codec.decode)(jax.lax.bitcast_convert_type(level, jnp.uint8), norms)
  assert not np.isfinite(np.asarray(decoded)).any()


@pytest.mark.parametrize("error_feedback", [False, True])
def test_mean_and_residual_equal_the_numpy_oracle(error_feedback, route):
  mesh = training.make_mesh(8)
  tx = jaxcomp.qsgd(LEVELS, "data", bucket_size=BUCKET, error_feedback=error_feedback, seed=SEED)
  state = training.init_state(tx, PARAMS, mesh, "data")
  rng = np.random.default_rng(0)
  grads = {"w": rng.normal(size=(8, 8, 6)).astype(np.float32),
           "b": rng.normal(size=(8, 5)).astype(np.float32)}
  out, new_state = jax.block_until_ready(training.make_update(tx, mesh, "data")(
      training.shard(grads, mesh, "data"), state))
  new_state = harness.state_rows(tx, new_state, PARAMS)
  n, block = 53, 7  # a bucket is at most a device's chunk: ceil(53 / 8) entries
  chunk = 7
  chunk_sums = np.zeros((8, chunk), np.float32)
  for device in range(8):
    corrected = np.concatenate([grads["b"][device], grads["w"][device].reshape(-1)])
    padded = np.pad(corrected, (0, 8 * chunk - n))
    decoded = _quantize(padded, _uniform(SEED, device, 0, 8 * chunk), LEVELS, block)
    chunk_sums += decoded.reshape(8, chunk) / 8
    if error_feedback:
      residual = np.concatenate([np.asarray(new_state.residual["b"][device]),
                                 np.asarray(new_state.residual["w"][device]).reshape(-1)])
      np.testing.assert_allclose(residual, corrected - decoded[:n], rtol=1e-5, atol=1e-6)
  mean = np.concatenate([
      _quantize(chunk_sums[j], _uniform(SEED, j, 1, chunk), LEVELS, block)
      for j in range(8)])[:n]
  got = np.concatenate([np.asarray(out["b"][0]), np.asarray(out["w"][0]).reshape(-1)])
  np.testing.assert_allclose(got, mean, rtol=1e-5, atol=1e-6)
  if not error_feedback:
    assert new_state.residual == ()


def test_quantization_is_unbiased_and_within_one_level():
  x = jnp.asarray(np.random.default_rng(1).normal(size=40).astype(np.float32))
  keys = jax.random.split(jax.random.key(0), 4000)
  levels, norms = jax.vmap(lambda k: qsgd.quantize(x, LEVELS, BUCKET, k))(keys)
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


def test_bytes_fall_like_a_dense_all_reduce():
  # 53 elements on 8 devices: chunks of 7 int8 levels and one f32 norm, 11 bytes,
  # sent to 7 devices in the all-to-all and again in the all-gather.
  assert wire.expected_bytes(jaxcomp.qsgd(8, "data", bucket_size=4096), PARAMS, 8).total == 154
  n = 1 << 20
  big = {"w": jax.ShapeDtypeStruct((n,), jnp.float32)}
  for devices in (8, 64):
    qsgd_bytes = wire.expected_bytes(jaxcomp.qsgd(8, "data"), big, devices).total
    dense = wire.expected_bytes(jaxcomp.allreduce("data"), big, devices).total
    assert 3.9 < dense / qsgd_bytes < 4.0


@hypothesis.settings(max_examples=16, deadline=None)
@hypothesis.given(
    bad=st.sampled_from([np.nan, -np.nan, np.inf, -np.inf]),
    positions=st.lists(st.integers(0, 64 * 80 + 16), min_size=1, max_size=3, unique=True),
    seed=st.integers(0, 2**16))
@pytest.mark.parametrize("codec", ["qsgd", "int8", "int4"])
@pytest.mark.parametrize("native_route", harness.NATIVE_ROUTES)
def test_a_non_finite_entry_makes_its_block_decode_non_finite(
    codec, native_route, bad, positions, seed):
  """What ``payload_carries_nonfinite`` rests on for the two-hop quantizers: a
  NaN or an infinity anywhere (the first entry of a block included, where
  XLA:CPU's vectorised ``max`` drops a NaN) gives its block a non-finite
  scale, and the block decodes to non-finite values; the other blocks stay
  finite. Sizes where XLA:CPU does reduce with its vectorised kernels."""
  block, size, n = 64, 88 * 64, 64 * 80 + 17
  tuning = selection.Tuning(native=native_route)
  codec = {"qsgd": lambda: qsgd._codec(LEVELS, block, jax.random.key(3), 1),
           "int8": lambda: quantized._codec(8, block),
           "int4": lambda: quantized._codec(4, block)}[codec]()
  x = np.random.default_rng(seed).normal(size=n).astype(np.float32) * np.float32(1e30)
  x[positions] = bad
  with mock.patch.dict(selection._BY_BACKEND, {"cpu": tuning}):
    payload, scales = jax.jit(lambda x: codec.encode(jnp.pad(x, (0, size - n)), 0))(x)
  decoded = np.asarray(codec.decode(payload, scales)).reshape(-1, block)
  hit = np.zeros(size // block, bool)
  hit[np.asarray(positions) // block] = True
  assert not np.isfinite(np.asarray(scales)[hit]).any()
  assert not np.isfinite(decoded[hit]).all(axis=1).any()
  assert np.isfinite(np.asarray(scales)[~hit]).all() and np.isfinite(decoded[~hit]).all()


@pytest.mark.parametrize("kwargs,error", [
    ({"levels": 0}, ValueError), ({"levels": 128}, ValueError), ({"levels": 2.5}, TypeError),
    ({"levels": 4, "bucket_size": 0}, ValueError), ({"levels": 4, "error_feedback": 1}, TypeError),
])
def test_bad_arguments(kwargs, error):
  with pytest.raises(error, match=next(iter(k for k in kwargs if k != "levels"), "levels")):
    jaxcomp.qsgd(axis_name="data", **kwargs)


def test_the_gradient_is_encoded_where_it_lies():
  """The fused gradient, a size no block divides, is padded to whole blocks by the
  concatenation that fuses it (``flat_length``): the norms' reduction does not
  read it through a slice, which XLA:CPU copies out first (two more passes).
  The only gradient-sized slicing left is the mean's split into leaves."""
  params = {f"w{i}": jnp.zeros((512, 512)) for i in range(4)} | {"b": jnp.zeros((40,))}
  n = 4 * 512 * 512 + 40
  mesh = training.make_mesh(1)
  tx = jaxcomp.qsgd(LEVELS, "data")
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  text = training.make_update(tx, mesh, "data").lower(grads, state).compile().as_text()
  heaviest = hlo_counts.count(text, n).heaviest
  slices = sum(row[0] for row in heaviest if row[3].endswith("/slice"))
  assert slices < 1.4, heaviest


@pytest.mark.parametrize("error_feedback, bucket_cap_mb", [(False, None), (True, 0.0001)])
def test_one_device_sends_its_payload_as_a_buffer_with_the_same_bits(
    error_feedback, bucket_cap_mb, monkeypatch):
  """On one device the first hop's payload is all-gathered, not all-to-all'ed (which
  XLA drops, fusing the encoding into both readers of the chunk's mean, each
  drawing the rounding again): the same mean, residual and key either way."""
  params = {"w": jnp.zeros((40, 30)), "b": jnp.zeros((7,)), "c": jnp.zeros((9, 9))}
  codec = qsgd._codec

  def run(draws):
    monkeypatch.setattr(qsgd, "_codec", lambda *a: codec(*a)._replace(draws=draws))
    runs = harness.run_two_steps(
        lambda axis: jaxcomp.qsgd(LEVELS, axis, bucket_size=BUCKET,
                                  error_feedback=error_feedback, bucket_cap_mb=bucket_cap_mb),
        params, 1, ("data",))
    buckets = len(jax.tree.leaves(runs["states"][0].residual)) if error_feedback else 1
    # The second hop's all-gather in each bucket, and the first's where it draws.
    assert runs["compiled"].as_text().count(" all-gather(") == buckets * (1 + draws)
    return runs["outs"], runs["states"]

  chex.assert_trees_all_equal(run(True), run(False))


# Twelve leaves of 600 entries. With buckets of 0.02 MiB, the first bucket holds nine
# of them, the second three; with buckets of 0.001 MiB, each leaf is a bucket.
_TWELVE = {f"w{i:02d}": jnp.zeros((20, 30)) for i in range(12)}


@harness.needs_native
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02, 0.001])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_the_norms_calls_agree_with_jax_s_route(bucket_cap_mb, error_feedback, monkeypatch):
  """The native route against JAX's over two steps on 8 devices: a bucket's first-hop
  norms from the call that encodes the leaves (and the residual) where it sums the
  bucket (else, a leaf of its own, from the call that encodes it), its second hop's
  from the call that encodes the chunk of the mean, and no branch of
  the norms; the means, the norms (the step's scales) and the residuals agree to
  rounding. The calls sum the squares in their own order, so a norm may move by an
  ulp or two (which moves a level only where a draw lies that close to its
  threshold: no entry of these data)."""
  buckets = {None: 1, 0.02: 2, 0.001: 12}[bucket_cap_mb]
  summed = 0 if buckets == 12 else buckets  # the buckets of more than one leaf

  def run(native_route):
    monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(native=native_route))
    runs = harness.run_two_steps(
        lambda axis: jaxcomp.qsgd(LEVELS, axis, bucket_size=64, error_feedback=error_feedback,
                                  bucket_cap_mb=bucket_cap_mb), _TWELVE, 8, ("data",))
    text = runs["compiled"].as_text()
    calls = tuple(text.count(f'custom_call_target="jaxcomp_{target}"') for target in (
        "corrected", "qsgd_encode", "qsgd_encode_leaves", "qsgd_residual"))
    return calls, text.count(" conditional("), runs["outs"], runs["rows"]

  calls, branches, *by_call = run(True)
  assert calls == (0, 2 * buckets - summed, summed, summed * int(error_feedback))
  xla_calls, xla_branches, *by_xla = run(False)
  assert xla_calls == (0, 0, 0, 0)
  assert xla_branches - branches == 2 * buckets  # the norms' branch on each hop
  chex.assert_trees_all_close(by_call, by_xla, rtol=1e-6, atol=1e-6)
