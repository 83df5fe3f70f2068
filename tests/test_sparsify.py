"""topk, gtopk and randomk on 8 fake CPU devices, against the numpy oracles of tests/harness.py.

The local selections they use are tested in tests/test_selection.py.
"""

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

from jaxcomp._src import dense
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import sparsify
from jaxcomp import training
from jaxcomp import wire
import harness

SHAPES = {"w": (16, 12), "b": (12,), "c": (3, 4, 5)}  # n = 264
N = 264

COMPRESSORS = {
    "topk": lambda d, a: sparsify.topk(d, a),
    "topk_no_ef": lambda d, a: sparsify.topk(d, a, error_feedback=False),
    "gtopk": lambda d, a: sparsify.gtopk(d, a),
    "randomk": lambda d, a: sparsify.randomk(d, a, seed=3),
}


def params_like(shapes=SHAPES):
  return {k: jnp.zeros(s) for k, s in shapes.items()}


def device_grads(num, seed=0, shapes=SHAPES):
  return harness.per_device_normal(params_like(shapes), seed, num)


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
  tx = COMPRESSORS[name](0.05, "data")
  got = harness.compiled_bytes_on_a_ring(tx, params_like(), device_grads(num), num)
  assert got.total == wire.expected_bytes(tx, params_like(), num).total


def test_randomk_torus_bytes_equal_formula():
  mesh = training.make_mesh((2, 4), ("x", "y"))
  tx = sparsify.randomk(0.25, ("x", "y"), seed=1)
  params = params_like()
  state = training.init_state(tx, params, mesh, ("x", "y"))
  step = harness.step_fn(tx, mesh, axis=("x", "y"))
  grads = jax.tree.map(lambda g: jnp.round(g * 64) / 64, device_grads(8))  # exact sums
  got = wire.collective_bytes(step.lower(grads, state).compile())
  want = wire.expected_bytes(tx, params, (2, 4))
  assert got.by_kind == want.by_kind
  assert "reduce-scatter" in got.by_kind
  out, _ = step(grads, state)
  harness.assert_same_on_devices(out)
  (draw,), _ = harness.step_draw_keys(1, 1)
  indices = harness.random_indices_reference(draw, N, math.ceil(0.25 * N))
  want_mean = np.zeros(N, np.float32)
  want_mean[indices] = harness.mean_reference([harness.flat(grads, d)[indices] for d in range(8)])
  harness.assert_bitwise_equal(harness.flat(out, 0), want_mean)


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
  out, new = harness.step_fn(tx, mesh8)(grads, state)
  base_tx = dense.allreduce("data")
  want, _ = harness.step_fn(base_tx, mesh8)(grads, training.init_state(
      base_tx, params_like(), mesh8, "data"))
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert not np.any(harness.flat(new.residual))


def topk_oracle(grads_by_device, residuals, k):
  """numpy: (mean, new residuals) of one topk step with error feedback.

  Each device sends its top-k of ``c = g + e`` divided by ``P``; the mean is
  the all-gathered pairs scatter-added in device order.
  """
  num = len(grads_by_device)
  blocks, new = [], []
  for g, e in zip(grads_by_device, residuals):
    c = g + e
    idx = harness.np_topk(c, k)
    blocks.append((harness.prescale(c[idx], num), idx))
    r = c.copy()
    r[idx] = 0
    new.append(r)
  values, indices = harness.sparse_allgather_reference(*zip(*blocks))
  return harness.densify_reference(values, indices, len(grads_by_device[0])), new


def assert_gathered_mean_close(got, want, corrected):
  """A mean scatter-added from every device's entries: its support exactly, its values
  to the rounding of the sum.

  Where several devices sent one index, XLA's scatter-add picks the order of their
  terms (at most P of them, each at most ``max|c| / P``), and the oracle's order is
  one of many: two orders differ by at most ``(P - 1) eps max|c|``.
  """
  np.testing.assert_array_equal(got != 0, want != 0)
  devices = len(corrected)
  largest = max(float(np.abs(c).max()) for c in corrected)
  atol = (devices - 1) * np.finfo(np.float32).eps * largest
  chex.assert_trees_all_close(got, want, rtol=0, atol=atol)


def test_topk_matches_numpy_over_two_steps(mesh8):
  tx = sparsify.topk(0.05, "data")
  k = math.ceil(0.05 * N)
  step = harness.step_fn(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  residuals = [np.zeros(N, np.float32)] * 8
  for seed in (0, 1):
    grads = device_grads(8, seed=seed)
    out, state = step(grads, state)
    corrected = [harness.flat(grads, d) + residuals[d] for d in range(8)]
    mean, residuals = topk_oracle([harness.flat(grads, d) for d in range(8)], residuals, k)
    harness.assert_same_on_devices(out)
    assert_gathered_mean_close(harness.flat(out, 0), mean, corrected)
    for d in range(8):
      # Mass conservation, bit for bit: the residual is c where not sent, 0 where sent.
      kept = harness.state_rows(tx, state, params_like()).residual
      np.testing.assert_array_equal(harness.flat(kept, d), residuals[d])


def test_topk_without_error_feedback_keeps_no_residual(mesh8):
  tx = sparsify.topk(0.05, "data", error_feedback=False)
  k = math.ceil(0.05 * N)
  state = training.init_state(tx, params_like(), mesh8, "data")
  assert state.residual == ()
  grads = device_grads(8, seed=2)
  out, _ = harness.step_fn(tx, mesh8)(grads, state)
  by_device = [harness.flat(grads, d) for d in range(8)]
  mean, _ = topk_oracle(by_device, [0.0] * 8, k)
  assert_gathered_mean_close(harness.flat(out, 0), mean, by_device)


@pytest.mark.parametrize("num", [2, 4, 6, 8])
def test_gtopk_matches_butterfly_oracle(num):
  mesh = training.make_mesh(num)
  tx = sparsify.gtopk(0.05, "data")
  k = math.ceil(0.05 * N)
  state = training.init_state(tx, params_like(), mesh, "data")
  grads = device_grads(num, seed=num)
  out, new = harness.step_fn(tx, mesh)(grads, state)
  harness.assert_same_on_devices(out)
  blocks, local = [], []
  for d in range(num):
    c = harness.flat(grads, d)
    idx = harness.np_topk(c, k)
    blocks.append((harness.prescale(c[idx], num), idx.astype(np.int32)))
    local.append(set(idx.tolist()))
  values, indices = harness.gtopk_allreduce_reference(blocks, k)
  want = harness.densify_reference(values, indices, N)
  harness.assert_bitwise_equal(harness.flat(out, 0), want)
  merged = set(indices.tolist())
  for d in range(num):
    # Put-back: selected locally and globally -> 0; everything else stays.
    c = harness.flat(grads, d)
    expect = c.copy()
    expect[sorted(local[d] & merged)] = 0
    kept = harness.state_rows(tx, new, params_like()).residual
    np.testing.assert_array_equal(harness.flat(kept, d), expect)


def test_randomk_matches_numpy_and_splits_key(mesh8):
  tx = sparsify.randomk(0.1, "data", seed=7)
  k = math.ceil(0.1 * N)
  step = harness.step_fn(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  residuals = [np.zeros(N, np.float32)] * 8
  chosen = []
  for seed in (0, 1):
    draws, key = harness.step_draw_keys(7, seed + 1)
    idx = harness.random_indices_reference(draws[-1], N, k)
    chosen.append(set(idx.tolist()))
    # On a grid of 1/64 every partial sum is exact: the mean is the oracle's bit for bit.
    grads = jax.tree.map(lambda g: jnp.round(g * 64) / 64, device_grads(8, seed=seed))
    out, state = step(grads, state)
    corrected = [harness.flat(grads, d) + residuals[d] for d in range(8)]
    want = np.zeros(N, np.float32)
    want[idx] = harness.mean_reference([c[idx] for c in corrected])
    harness.assert_same_on_devices(out)
    harness.assert_bitwise_equal(harness.flat(out, 0), want)
    residuals = []
    for c in corrected:
      r = c.copy()
      r[idx] = 0
      residuals.append(r)
    rows = harness.state_rows(tx, state, params_like())
    for d in range(8):
      np.testing.assert_array_equal(harness.flat(rows.residual, d), residuals[d])
    np.testing.assert_array_equal(
        np.asarray(rows.rng_key[3]), np.asarray(jax.random.key_data(key)))
  assert len(chosen[0]) == k and chosen[0] != chosen[1]


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
    local = training.blocks_to_local(state, jax.eval_shape(tx.init, g))
    total, s = jax.lax.fori_loop(0, steps, body, (zero, local))
    return jax.tree.map(lambda x: x[None], total), training.local_to_blocks(s)

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
  tx = COMPRESSORS[name](density, "data")
  total, state = run_constant(tx, mesh, grads, steps)
  by_device = np.stack([harness.flat(grads, d) for d in range(8)])
  kept = harness.state_rows(tx, state, jax.tree.map(lambda x: x[0], grads)).residual
  residual = np.stack([harness.flat(kept, d) for d in range(8)])
  want = steps * by_device.mean(0) - residual.mean(0)
  np.testing.assert_allclose(harness.flat(total, 0), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ random indices


@pytest.mark.parametrize("n, k", [(50, 10), (23, 5), (10, 9), (7, 1)])
def test_random_indices_are_distinct_in_range_and_uniform(n, k):
  """Sorted distinct indices of [0, n); every coordinate drawn with probability k / n.

  Rows are independent, so a coordinate's count over T rows is Binomial(T, k / n)
  exactly; 4 sd separates it from the strata alone (23, 5: 1/4 or 1/5, not 5/23).
  """
  rows = 20_000
  draws = np.asarray(jax.jit(jax.vmap(lambda key: sparsify.random_indices(key, n, k)))(
      jax.random.split(jax.random.key(0), rows)))
  assert draws.dtype == np.int32 and draws.shape == (rows, k)
  assert draws.min() >= 0 and draws.max() < n
  assert np.all(np.diff(draws, axis=1) > 0)  # sorted, hence distinct
  p = k / n
  counts = np.bincount(draws.reshape(-1), minlength=n)
  assert np.all(np.abs(counts - rows * p) < 4 * np.sqrt(rows * p * (1 - p)))


def test_random_indices_of_every_coordinate():
  every = sparsify.random_indices(jax.random.key(0), 7, 7)
  np.testing.assert_array_equal(np.asarray(every), np.arange(7))


@pytest.mark.parametrize("n, k", [(N, 27), (N, N - 1), (2**31 - 1, 1000)])
def test_random_indices_follow_the_documented_law(n, k):
  """The documented rule, rebuilt in numpy from the draws (int64: n near 2**31 cannot wrap)."""
  for key in jax.random.split(jax.random.key(4), 5):
    got = np.asarray(jax.jit(sparsify.random_indices, static_argnums=(1, 2))(key, n, k))
    harness.assert_bitwise_equal(got, harness.random_indices_reference(key, n, k))


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(n=st.integers(2, 40), data=st.data())
def test_rotated_strata_at_every_rotation(n, data):
  """Every rotation r of [0, n), with draws small and near 2**32 (so that the first and
  the last position of a stratum come up): the wrapped count taken from the stratum
  holding n - r, with no sum and no roll, puts each index where the sorted rule does."""
  k = data.draw(st.integers(1, n - 1), label="k")
  draw = st.one_of(st.integers(0, n), st.integers(2**32 - n, 2**32 - 1))
  drawn = np.asarray(data.draw(st.lists(draw, min_size=k, max_size=k), label="drawn"),
                     np.uint32)
  rotated = jax.jit(lambda r: sparsify._rotated_strata(
      lambda stratum: jnp.asarray(drawn)[stratum], r, n, k))
  for r in range(n):
    harness.assert_bitwise_equal(np.asarray(rotated(jnp.int32(r))),
                                 harness.rotated_strata_reference(drawn, r, n))


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
  want, want_state = harness.step_fn(tx, mesh8)(grads, state)
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (8,) + x.shape), tx.init(params_like()))
  out, new = jax.pmap(tx.update, axis_name="data")(grads, stacked)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, want))
  want_state = training.device_rows(want_state, jax.eval_shape(tx.init, params_like()))
  chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, new), jax.tree.map(np.asarray, want_state))


def test_inside_multisteps(mesh8):
  """Gradients accumulate locally; the compressor runs every second step."""
  params = params_like()
  tx = optax.MultiSteps(optax.chain(sparsify.randomk(1.0, "data"), optax.sgd(1.0)), 2)
  state = training.init_state(tx, params, mesh8, "data")

  def per_device(grads, state):
    local = training.blocks_to_local(state, jax.eval_shape(tx.init, params))
    out, state = tx.update(jax.tree.map(lambda x: x[0], grads), local, params)
    return jax.tree.map(lambda x: x[None], out), training.local_to_blocks(state)

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


# ------------------------------------------------------------ the selection route


@pytest.mark.parametrize("native", [True, False])
def test_large_buckets_select_exactly_as_lax_top_k(mesh8, monkeypatch, native):
  """topk and gtopk on the exact route (the native custom call where it is built, else
  exact_topk in JAX) agree bit for bit with the lax.top_k path.

  (random-k draws its indices without a selection.)
  """
  n = 20_000
  grads = [device_grads(8, seed=s, shapes={"g": (n,)}) for s in (2, 3)]
  for name in ("topk", "gtopk"):
    results, programs = [], []
    for exact_min_size in (n, n + 1):  # exact_topk, then lax.top_k
      monkeypatch.setattr(selection, "tuning_for",
                          lambda backend=None, size=exact_min_size: selection.Tuning(
                              exact_min_size=size, native=native))
      tx = COMPRESSORS[name](0.01, "data")
      state = training.init_state(tx, {"g": jnp.zeros(n)}, mesh8, "data")
      step = harness.step_fn(tx, mesh8)
      programs.append(step.lower(grads[0], state).as_text())
      for g in grads:
        out, state = jax.block_until_ready(step(g, state))
      results.append(jax.tree.leaves((out, state)))
    assert programs[0] != programs[1]  # two routes were compiled
    for a, b in zip(*results):
      harness.assert_bitwise_equal(a, b)


def test_buckets_of_about_one_size_select_in_one_shape_exactly(mesh8, monkeypatch):
  """With buckets, topk and gtopk zero-pad each bucket on the exact route to a
  multiple of a 16th of the cap: buckets of about one size share the selection's
  length (one compiled shape), and everything is as through lax.top_k on the
  unpadded buckets, bit for bit, over two steps (residuals included), and the
  bytes are the formula's."""
  cap_mb = 0.1  # 26,214 f32 entries: every leaf closes its bucket; a 16th is 1,638
  shapes = {"a": (27_000,), "b": (26_500,), "c": (28_000,)}
  grads = [device_grads(8, seed=s, shapes=shapes) for s in (4, 5)]
  for name in ("topk", "gtopk"):
    results, lengths = [], []
    for exact_min_size in (20_000, None):  # exact_topk on padded buckets, then lax.top_k
      monkeypatch.setattr(selection, "tuning_for",
                          lambda backend=None, size=exact_min_size: selection.Tuning(
                              exact_min_size=size, native=False))
      tx = getattr(sparsify, name)(0.01, "data", bucket_cap_mb=cap_mb)
      spec = protocol.spec(tx)
      lengths.append([spec.method.flat_length(b, 8) for b in spec.fused.plan(params_like(shapes))])
      state = training.init_state(tx, params_like(shapes), mesh8, "data")
      step = harness.step_fn(tx, mesh8)
      # Each bucket sends its own k, not the padded capacity.
      read = wire.collective_bytes(step.lower(grads[0], state).compile())
      assert read.total == wire.expected_bytes(tx, params_like(shapes), 8).total
      for g in grads:
        out, state = jax.block_until_ready(step(g, state))
      results.append(jax.tree.leaves((out, state)))
    # Reverse tree order: c, b, a; b and a round up to 17 sixteenths, c to 18.
    assert lengths == [[18 * 1638, 17 * 1638, 17 * 1638], [28_000, 26_500, 27_000]]
    for a, b in zip(*results):
      harness.assert_bitwise_equal(a, b)
