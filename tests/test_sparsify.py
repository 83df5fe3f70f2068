"""topk, gtopk, randomk and the local selections, on 8 fake CPU devices."""

from fractions import Fraction
import math

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import numpy as np
import optax
import pytest

from jaxcomp import collectives
from jaxcomp import dense
from jaxcomp import sparsify
from jaxcomp import training
import harness
from jaxcomp import wire

EMPTY = collectives.EMPTY_INDEX
SHAPES = {"w": (16, 12), "b": (12,), "c": (3, 4, 5)}  # n = 264
N = 264

COMPRESSORS = {
    "topk": lambda d, a: sparsify.topk(d, a),
    "topk_no_ef": lambda d, a: sparsify.topk(d, a, error_feedback=False),
    "gtopk": lambda d, a: sparsify.gtopk(d, a),
    "randomk": lambda d, a: sparsify.randomk(d, a, seed=3),
}


def params_like():
  return {k: jnp.zeros(s) for k, s in SHAPES.items()}


def device_grads(num, seed=0, shapes=SHAPES):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {
      name: jax.random.normal(key, (num,) + shape)
      for key, (name, shape) in zip(keys, sorted(shapes.items()))
  }


def sharded_update(tx, mesh, axis="data", wrap=None):
  """jit(shard_map) of ``tx.update`` over stacked grads and states."""
  return training.make_update(tx, mesh, axis, wrap=wrap)


@pytest.fixture(scope="module")
def mesh8():
  return training.make_mesh(8)


# ------------------------------------------------------------------ contract


def test_mismatched_updates_raise():
  tx = sparsify.gtopk(0.1, "data")
  state = tx.init(params_like())
  with pytest.raises(ValueError, match="shape"):
    tx.update({"w": jnp.zeros((16, 11)), "b": jnp.zeros(12), "c": jnp.zeros((3, 4, 5))}, state)


# ------------------------------------------------------------------ bytes


@pytest.mark.parametrize("num", [2, 4, 8])
@pytest.mark.parametrize("name", ["topk", "gtopk", "randomk"])
def test_compiled_bytes_equal_formula(name, num):
  mesh = training.make_mesh(num)
  tx = COMPRESSORS[name](0.05, "data")
  params = params_like()
  state = training.init_state(tx, params, mesh, "data")
  compiled = sharded_update(tx, mesh).lower(device_grads(num), state).compile()
  got = wire.collective_bytes(compiled)
  want = wire.expected_bytes(tx, params, num)
  assert got.by_kind == want.by_kind
  assert got.total == want.total


def test_randomk_torus_bytes_equal_formula():
  mesh = training.make_mesh((2, 4), ("x", "y"))
  tx = sparsify.randomk(0.25, ("x", "y"), seed=1)
  params = params_like()
  state = training.init_state(tx, params, mesh, ("x", "y"))
  step = sharded_update(tx, mesh, axis=("x", "y"))
  grads = device_grads(8)
  got = wire.collective_bytes(step.lower(grads, state).compile())
  want = wire.expected_bytes(tx, params, (2, 4))
  assert got.by_kind == want.by_kind
  assert "reduce-scatter" in got.by_kind
  out, _ = step(grads, state)
  harness.assert_same_on_devices(out)
  indices = np.asarray(sparsify.random_indices(
      jax.random.split(jax.random.key(1))[1], N, math.ceil(0.25 * N)))
  want_mean = np.zeros(N, np.float32)
  want_mean[indices] = np.stack([harness.flat(grads, d) for d in range(8)]).mean(0)[indices]
  np.testing.assert_allclose(harness.flat(out, 0), want_mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num", [2, 4, 8])
def test_gtopk_to_topk_byte_ratio(num):
  params = params_like()
  k = math.ceil(0.05 * N)
  gtopk_bytes = wire.expected_bytes(sparsify.gtopk(0.05, "data"), params, num).total
  topk_bytes = wire.expected_bytes(sparsify.topk(0.05, "data"), params, num).total
  assert gtopk_bytes == int(math.log2(num)) * 8 * k
  assert topk_bytes == (num - 1) * 8 * k
  assert gtopk_bytes / topk_bytes == Fraction(int(math.log2(num)), num - 1)


# ------------------------------------------------------------------ semantics


@pytest.mark.parametrize("name", ["topk", "gtopk", "randomk"])
def test_full_density_equals_allreduce(name, mesh8):
  tx = COMPRESSORS[name](1.0, "data")
  grads = device_grads(8, seed=5)
  state = training.init_state(tx, params_like(), mesh8, "data")
  out, new = sharded_update(tx, mesh8)(grads, state)
  base_tx = dense.allreduce("data")
  want, _ = sharded_update(base_tx, mesh8)(grads, training.init_state(
      base_tx, params_like(), mesh8, "data"))
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert not np.any(harness.flat(new.residual))


def topk_oracle(grads_by_device, residuals, k):
  """numpy: (mean, new residuals) of one topk step with error feedback."""
  num = len(grads_by_device)
  mean = np.zeros_like(grads_by_device[0])
  new = []
  for g, e in zip(grads_by_device, residuals):
    c = g + e
    idx = harness.np_topk(c, k)
    mean[idx] += c[idx]
    r = c.copy()
    r[idx] = 0
    new.append(r)
  return mean / num, new


def test_topk_matches_numpy_over_two_steps(mesh8):
  tx = sparsify.topk(0.05, "data")
  k = math.ceil(0.05 * N)
  step = sharded_update(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  residuals = [np.zeros(N, np.float32)] * 8
  for seed in (0, 1):
    grads = device_grads(8, seed=seed)
    out, state = step(grads, state)
    mean, residuals = topk_oracle([harness.flat(grads, d) for d in range(8)], residuals, k)
    np.testing.assert_allclose(harness.flat(out, 0), mean, rtol=1e-6, atol=1e-7)
    for d in range(8):
      # Mass conservation, bit for bit: the residual is c where not sent, 0 where sent.
      np.testing.assert_array_equal(harness.flat(state.residual, d), residuals[d])


def test_topk_without_error_feedback_keeps_no_residual(mesh8):
  tx = sparsify.topk(0.05, "data", error_feedback=False)
  k = math.ceil(0.05 * N)
  state = training.init_state(tx, params_like(), mesh8, "data")
  assert state.residual == ()
  grads = device_grads(8, seed=2)
  out, _ = sharded_update(tx, mesh8)(grads, state)
  mean, _ = topk_oracle([harness.flat(grads, d) for d in range(8)], [0.0] * 8, k)
  np.testing.assert_allclose(harness.flat(out, 0), mean, rtol=1e-6, atol=1e-7)


def merge_np(a, b, k):
  """The spec of merge_topk: sum of two sparse dicts, k largest |v| (ties: lower index)."""
  total = dict(a)
  for i, v in b.items():
    total[i] = np.float32(total[i] + v) if i in total else v
  order = sorted(total, key=lambda i: (-abs(total[i]), i))[:k]
  return {i: total[i] for i in order}


def gtopk_oracle(blocks, k):
  """The butterfly of gtopk_allreduce over per-device sparse dicts (any P)."""
  size = len(blocks)
  power = 1 << (size.bit_length() - 1)
  blocks = list(blocks)
  for j in range(size - power):
    blocks[j] = merge_np(blocks[j], blocks[power + j], k)
  distance = 1
  while distance < power:
    blocks = [merge_np(blocks[i], blocks[i ^ distance], k) for i in range(power)]
    distance *= 2
  return blocks[0]


@pytest.mark.parametrize("num", [2, 4, 6, 8])
def test_gtopk_matches_butterfly_oracle(num):
  mesh = training.make_mesh(num)
  tx = sparsify.gtopk(0.05, "data")
  k = math.ceil(0.05 * N)
  state = training.init_state(tx, params_like(), mesh, "data")
  grads = device_grads(num, seed=num)
  out, new = sharded_update(tx, mesh)(grads, state)
  harness.assert_same_on_devices(out)
  local = []
  for d in range(num):
    c = harness.flat(grads, d)
    idx = harness.np_topk(c, k)
    local.append({int(i): c[i] for i in idx})
  merged = gtopk_oracle(local, k)
  want = np.zeros(N, np.float32)
  for i, v in merged.items():
    want[i] = v / num
  np.testing.assert_allclose(harness.flat(out, 0), want, rtol=1e-6, atol=1e-7)
  for d in range(num):
    # Put-back: selected locally and globally -> 0; everything else stays.
    c = harness.flat(grads, d)
    expect = c.copy()
    expect[[i for i in local[d] if i in merged]] = 0
    np.testing.assert_array_equal(harness.flat(new.residual, d), expect)


def test_randomk_matches_numpy_and_splits_key(mesh8):
  tx = sparsify.randomk(0.1, "data", seed=7)
  k = math.ceil(0.1 * N)
  step = sharded_update(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  key = jax.random.key(7)
  residuals = [np.zeros(N, np.float32)] * 8
  chosen = []
  for seed in (0, 1):
    key, draw = jax.random.split(key)
    idx = np.asarray(sparsify.random_indices(draw, N, k))
    chosen.append(set(idx.tolist()))
    grads = device_grads(8, seed=seed)
    out, state = step(grads, state)
    corrected = [harness.flat(grads, d) + residuals[d] for d in range(8)]
    want = np.zeros(N, np.float32)
    want[idx] = np.mean([c[idx] for c in corrected], axis=0)
    np.testing.assert_allclose(harness.flat(out, 0), want, rtol=1e-6, atol=1e-7)
    residuals = []
    for c in corrected:
      r = c.copy()
      r[idx] = 0
      residuals.append(r)
    for d in range(8):
      np.testing.assert_array_equal(harness.flat(state.residual, d), residuals[d])
    np.testing.assert_array_equal(
        np.asarray(state.rng_key[3]), np.asarray(jax.random.key_data(key)))
  assert len(chosen[0]) == k and chosen[0] != chosen[1]


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_nan_on_one_device_poisons_all_and_keeps_state(name, mesh8):
  tx = COMPRESSORS[name](0.05, "data")
  step = sharded_update(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  _, state = step(device_grads(8, seed=1), state)
  grads = device_grads(8, seed=2)
  grads["b"] = grads["b"].at[5, 3].set(jnp.nan)
  out, new = step(grads, state)
  for d in range(8):
    assert not np.all(np.isfinite(harness.flat(out, d)))
  chex.assert_trees_all_equal(new, state)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new))


def run_constant(tx, mesh, grads, steps):
  """Sum over ``steps`` of the outputs for a constant gradient, and the last state."""

  def per_device(grads, state):
    first = lambda t: jax.tree.map(lambda x: x[0], t)
    g = first(grads)

    def body(_, carry):
      total, s = carry
      out, s = tx.update(g, s)
      return jax.tree.map(jnp.add, total, out), s

    zero = jax.tree.map(jnp.zeros_like, g)
    total, s = jax.lax.fori_loop(0, steps, body, (zero, first(state)))
    add = lambda t: jax.tree.map(lambda x: x[None], t)
    return add(total), add(s)

  spec = PartitionSpec("data")
  state = training.init_state(tx, jax.tree.map(lambda x: x[0], grads), mesh, "data")
  return jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
      check_vma=False,
  ))(grads, state)


@hypothesis.settings(max_examples=4)
@hypothesis.given(
    name=st.sampled_from(["topk", "randomk"]),
    shape=st.sampled_from([(64,), (8, 24)]),
    density=st.sampled_from([0.05, 0.3]),
)
def test_error_feedback_tracks_running_mean(name, shape, density):
  """Sum of outputs == T * mean - mean of the residuals (the residual is what lags)."""
  mesh = training.make_mesh(8)
  steps = 12
  grads = device_grads(8, seed=11, shapes={"g": shape})
  total, state = run_constant(COMPRESSORS[name](density, "data"), mesh, grads, steps)
  by_device = np.stack([harness.flat(grads, d) for d in range(8)])
  residual = np.stack([harness.flat(state.residual, d) for d in range(8)])
  want = steps * by_device.mean(0) - residual.mean(0)
  np.testing.assert_allclose(harness.flat(total, 0), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ selection


def test_select_topk_masks_to_k():
  x = jnp.asarray(np.random.default_rng(0).normal(size=500).astype(np.float32))
  values, indices = jax.jit(lambda x, k: sparsify.select_topk(x, 20, k))(x, 12)
  want = harness.np_topk(np.asarray(x), 12)
  np.testing.assert_array_equal(np.asarray(indices[:12]), want)
  np.testing.assert_array_equal(np.asarray(values[:12]), np.asarray(x)[want])
  assert np.all(np.asarray(indices[12:]) == EMPTY) and not np.any(np.asarray(values[12:]))


@pytest.mark.parametrize("n", [31, 32, 1000, 4099])
def test_compact_matches_nonzero(n):
  x = np.random.default_rng(n).normal(size=n).astype(np.float32)
  threshold = np.float32(1.0)
  bits = jax.lax.bitcast_convert_type(jnp.float32(threshold), jnp.int32)
  capacity = max(1, n // 4)
  index, total = jax.jit(sparsify._compact, static_argnums=2)(jnp.asarray(x), bits, capacity)
  want = np.nonzero(np.abs(x) >= threshold)[0]
  assert int(total) == len(want)
  got = np.asarray(index)
  np.testing.assert_array_equal(got[:min(capacity, len(want))], want[:capacity])
  assert np.all(got[len(want):] == EMPTY)


def test_kth_largest_bits_matches_sort():
  x = np.abs(np.random.default_rng(1).normal(size=3000)).astype(np.float32)
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.int32)
  for k in (1, 17, 3000):
    got = jax.lax.bitcast_convert_type(sparsify._kth_largest_bits(bits, k), jnp.float32)
    assert float(got) == np.sort(x)[-k]


@pytest.mark.parametrize("ratio", [0.02, 0.2])
def test_sampled_topk_is_exact_top_k_when_the_count_fits(ratio):
  n, k = 65536, 400
  x = jnp.asarray(np.random.default_rng(3).normal(size=n).astype(np.float32))
  select = jax.jit(lambda x, key: sparsify.sampled_topk(x, k, k, key, ratio))
  values, indices = select(x, jax.random.key(0))
  got = np.sort(np.asarray(indices))
  np.testing.assert_array_equal(got, np.sort(harness.np_topk(np.asarray(x), k)))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(x)[np.asarray(indices)])


def test_sampled_threshold_candidates_fit_the_capacity():
  """On Gaussian data the sampled path is taken: k <= count <= 2 k candidates."""
  n, k = 65536, 400
  x = np.random.default_rng(4).normal(size=n).astype(np.float32)
  capacity = sparsify.candidate_capacity(n, k)
  assert capacity == sparsify.CANDIDATE_FACTOR * k
  find = jax.jit(lambda x, key: sparsify.threshold_candidates(x, k, key, 0.05, capacity))
  for seed in range(3):
    index, total = find(jnp.asarray(x), jax.random.key(seed))
    assert k <= int(total) <= capacity
    got = np.asarray(index)[:int(total)]
    cut = np.abs(x[got]).min()
    np.testing.assert_array_equal(got, np.nonzero(np.abs(x) >= cut)[0])
    assert np.all(np.asarray(index)[int(total):] == EMPTY)


def test_sampled_topk_falls_back_when_the_count_is_off():
  n, k = 4096, 40
  # Equal magnitudes: everything is above any threshold, far above the capacity.
  select = jax.jit(lambda x, key, ratio: sparsify.sampled_topk(x, k, k, key, ratio),
                   static_argnums=2)
  x = jnp.ones(n).at[100].set(3.0)
  _, indices = select(x, jax.random.key(0), 0.1)
  np.testing.assert_array_equal(np.asarray(indices), harness.np_topk(np.asarray(x), k))
  # A few large entries the sample misses: too few above the threshold.
  y = jnp.zeros(n).at[jnp.arange(0, 4 * k, 4)].set(jnp.arange(1, k + 1, dtype=jnp.float32))
  _, indices = select(y, jax.random.key(1), 0.01)
  np.testing.assert_array_equal(np.sort(np.asarray(indices)), np.arange(0, 4 * k, 4))


def test_random_indices_are_distinct_and_uniform():
  draws = jax.vmap(lambda key: sparsify.random_indices(key, 50, 10))(
      jax.random.split(jax.random.key(0), 2000))
  draws = np.asarray(draws)
  assert all(len(set(row)) == 10 for row in draws)
  assert np.all(np.diff(draws, axis=1) > 0)
  counts = np.bincount(draws.reshape(-1), minlength=50)
  assert counts.min() > 320 and counts.max() < 480  # 400 expected, sd 18
  every = sparsify.random_indices(jax.random.key(0), 7, 7)
  np.testing.assert_array_equal(np.asarray(every), np.arange(7))


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("factory", ["topk", "gtopk", "randomk"])
@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_bad_density(factory, density):
  with pytest.raises(ValueError, match="`density` must be in \\(0, 1\\]"):
    getattr(sparsify, factory)(density, "data")


@pytest.mark.parametrize("factory", ["topk", "gtopk", "randomk"])
def test_bad_axis_name(factory):
  with pytest.raises(ValueError, match="`axis_name`"):
    getattr(sparsify, factory)(0.1, "")
  with pytest.raises(TypeError, match="`axis_name`"):
    getattr(sparsify, factory)(0.1, 3)


def test_bad_other_arguments():
  with pytest.raises(TypeError, match="`density`"):
    sparsify.topk("0.1", "data")
  with pytest.raises(TypeError, match="`error_feedback`"):
    sparsify.topk(0.1, "data", error_feedback="yes")
  with pytest.raises(ValueError, match="`seed` must be in \\[0, 2\\*\\*32\\)"):
    sparsify.randomk(0.1, "data", seed=-1)
  with pytest.raises(TypeError, match="`seed`"):
    sparsify.randomk(0.1, "data", seed=1.5)


# ------------------------------------------------------------------ pmap, MultiSteps


def test_pmap_gives_the_shard_map_result(mesh8):
  tx = sparsify.gtopk(0.1, "data")
  grads = device_grads(8, seed=9)
  state = training.init_state(tx, params_like(), mesh8, "data")
  want, want_state = sharded_update(tx, mesh8)(grads, state)
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (8,) + x.shape), tx.init(params_like()))
  out, new = jax.pmap(tx.update, axis_name="data")(grads, stacked)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, want))
  chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, new), jax.tree.map(np.asarray, want_state))


def test_inside_multisteps(mesh8):
  """Gradients accumulate locally; the compressor runs every second step."""
  params = params_like()
  tx = optax.MultiSteps(optax.chain(sparsify.randomk(1.0, "data"), optax.sgd(1.0)), 2)
  state = training.init_state(tx, params, mesh8, "data")

  def per_device(grads, state):
    first = lambda t: jax.tree.map(lambda x: x[0], t)
    out, state = tx.update(first(grads), first(state), params)
    add = lambda t: jax.tree.map(lambda x: x[None], t)
    return add(out), add(state)

  spec = PartitionSpec("data")
  step = jax.jit(jax.shard_map(
      per_device, mesh=mesh8, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False
  ))
  first_grads, second_grads = device_grads(8, seed=1), device_grads(8, seed=2)
  out, state = step(first_grads, state)
  assert not np.any(harness.flat(out))
  out, state = step(second_grads, state)
  harness.assert_same_on_devices(out)
  want = -np.mean([(harness.flat(first_grads, d) + harness.flat(second_grads, d)) / 2 for d in range(8)], 0)
  np.testing.assert_allclose(harness.flat(out, 0), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ exact selection


def _exact_topk(x, capacity, seed=0, ratio=None):
  select = jax.jit(lambda x, key: sparsify.exact_topk(x, capacity, key, ratio))
  return select(jnp.asarray(x), jax.random.key(seed))


def _assert_same_as_lax_top_k(x, capacity, values, indices):
  """The set ``lax.top_k`` selects (ties and NaN ordered alike), in index order."""
  x = np.asarray(x)
  _, want = jax.lax.top_k(jnp.abs(jnp.asarray(x)), capacity)
  want = np.sort(np.asarray(want))
  np.testing.assert_array_equal(np.asarray(indices), want)
  np.testing.assert_array_equal(np.asarray(values).view(np.uint32), x[want].view(np.uint32))


@pytest.mark.parametrize("n,k", [(65536, 400), (300_000, 300), (2**20, 1049)])
def test_exact_topk_takes_the_sampled_path_and_is_exact(n, k):
  x = np.random.default_rng(n).normal(size=n).astype(np.float32)
  candidates = sparsify.candidate_capacity(n, k)
  ratio = sparsify.exact_sample_ratio(n, k)
  _, total = sparsify.threshold_candidates(
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


def test_exact_topk_orders_nan_and_infinities_as_lax_top_k():
  n, k = 8192, 64
  x = np.random.default_rng(5).normal(size=n).astype(np.float32)
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


def test_exact_topk_of_everything_is_every_index():
  x = np.random.default_rng(6).normal(size=100).astype(np.float32)
  values, indices = _exact_topk(x, 100)
  np.testing.assert_array_equal(np.asarray(indices), np.arange(100))
  np.testing.assert_array_equal(np.asarray(values), x)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    n=st.integers(64, 6000),
    density=st.sampled_from([0.001, 0.01, 0.1, 0.5]),
    levels=st.sampled_from([3, 50, None]),
    seed=st.integers(0, 2**16),
    ratio=st.sampled_from([0.01, 0.1, 0.5]),
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


def test_large_buckets_select_exactly_as_lax_top_k(mesh8, monkeypatch):
  """topk and gtopk through exact_topk agree bit for bit with the lax.top_k path."""
  n = 20_000
  grads = device_grads(8, seed=2, shapes={"g": (n,)})
  for name in ("topk", "gtopk", "randomk"):
    results = []
    for fast_min in (n, n + 1):  # exact_topk, then lax.top_k
      monkeypatch.setattr(sparsify, "EXACT_FAST_MIN", fast_min)
      tx = COMPRESSORS[name](0.01, "data")
      state = training.stack_per_device(tx.init({"g": jnp.zeros(n)}), mesh8, "data")
      step = sharded_update(tx, mesh8)
      out, new = step(grads, state)
      out, new = step(device_grads(8, seed=3, shapes={"g": (n,)}), new)
      results.append(jax.tree.leaves((out, new)))
    for a, b in zip(*results):
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
