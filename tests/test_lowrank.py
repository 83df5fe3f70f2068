"""PowerSGD and ACP-SGD on 8 fake CPU devices, against numpy oracles."""

import functools

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_compression
from experiments import hlo_counts
from experiments import shapes
from jaxcomp._src import dense as dense_lib
from jaxcomp._src import fusion
from jaxcomp._src import lowrank
from jaxcomp import protocol
from jaxcomp import training
from jaxcomp import wire
import harness

RANK = 2
# conv (36 x 8) and two dense (16 x 12) kernels are compressed at rank 2;
# the bias and the (2 x 3) matrix go dense.
PARAMS = {
    "conv": jnp.zeros((3, 3, 4, 8)),
    "dense": {"kernel": jnp.zeros((16, 12)), "bias": jnp.zeros((12,))},
    "dense2": jnp.zeros((16, 12)),
    "small": jnp.zeros((2, 3)),
}
COMPRESSED = ("conv", "dense.kernel", "dense2")
FACTORIES = {
    "powersgd": lambda axis: lowrank.powersgd(RANK, axis),
    "powersgd_cold": lambda axis: lowrank.powersgd(RANK, axis, warm_start=False),
    "acpsgd": lambda axis: lowrank.acpsgd(RANK, axis),
}
MESHES = {"1d": (8, ("data",)), "2x4": ((2, 4), ("x", "y"))}


@pytest.fixture
def xla_route(monkeypatch):
  """The products, orthonormalisations and residual in XLA: the route of GPUs and of a CPU
  without the custom calls (on CPU the calls take them where they are built)."""
  monkeypatch.setattr(lowrank, "_native", lambda view: False)


def _leaf(tree, path):
  for part in path.split("."):
    tree = tree[part]
  return tree


_per_device_normal = functools.partial(harness.per_device_normal, PARAMS)
_run = harness.two_step_runs(FACTORIES, PARAMS, MESHES)


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _gram_schmidt(a):
  a = a.copy()
  for i in range(a.shape[1]):
    for j in range(i):
      a[:, i] -= (a[:, j] @ a[:, i]) * a[:, j]
    norm = np.linalg.norm(a[:, i])
    a[:, i] /= norm if norm else 1.0
  return a


def _factor(flat, path, which, params=PARAMS):
  """One leaf's factor out of a state's flat buffer, laid out by the matrix view."""
  view = lowrank.MatrixView.of(params, RANK, 2.0)
  paths = [_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  factors = view.p_factors(flat) if which == "p" else view.q_factors(flat)
  in_bucket_order = [batch[j] for batch in factors for j in range(batch.shape[0])]
  k = view.lowrank.leaves.index(paths.index(path))
  return np.asarray(in_bucket_order[k], np.float64)


def _path(key_path):
  return ".".join(str(k.key) for k in key_path)


def _matrix(x):
  return x.reshape(-1, x.shape[-1])


# ------------------------------------------------------------------- contract


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", FACTORIES)
def test_factors_identical_on_every_device(name, mesh_name):
  """The carried factors agree across devices (the mean's agreement is the contract suite's)."""
  state = _run(name, mesh_name)["rows"][-1]
  for factor in (state.q,) + ((state.p,) if name == "acpsgd" else ()):
    factor = np.asarray(factor)
    np.testing.assert_array_equal(factor, np.broadcast_to(factor[:1], factor.shape))


# ---------------------------------------------------------------------- bytes


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_compiled_bytes_on_smaller_rings(name, devices):
  mesh = training.make_mesh(devices)
  tx = FACTORIES[name]("data")
  state = training.init_state(tx, PARAMS, mesh, "data")
  grads = training.shard(_per_device_normal(5, devices=devices), mesh, "data")
  compiled = harness.step_fn(tx, mesh, "data").lower(grads, state).compile()
  assert wire.collective_bytes(compiled).by_kind == (
      wire.expected_bytes(tx, PARAMS, devices).by_kind)


@pytest.mark.parametrize("name", FACTORIES)
def test_torus_pattern(name):
  ops = wire.collective_bytes(_run(name, "2x4")["compiled"]).ops
  kinds = [(op.kind, op.group_size) for op in ops]
  assert kinds == [("reduce-scatter", 2), ("all-reduce", 4), ("all-gather", 2)] * 2


def test_acpsgd_sends_fewer_bytes_than_powersgd():
  for mesh_name in MESHES:
    acp = wire.collective_bytes(_run("acpsgd", mesh_name)["compiled"]).total
    power = wire.collective_bytes(_run("powersgd", mesh_name)["compiled"]).total
    assert 0 < acp < power
  for model in (shapes.resnet50(), shapes.transformer()):
    acp = wire.expected_bytes(lowrank.acpsgd(4, "data"), model, 8).total
    power = wire.expected_bytes(lowrank.powersgd(4, "data"), model, 8).total
    dense = wire.expected_bytes(dense_lib.allreduce("data"), model, 8).total
    assert acp < power < dense


def test_acpsgd_one_fused_allreduce_per_branch():
  view = lowrank.MatrixView.of(PARAMS, RANK, 2.0)
  ops = wire.collective_bytes(_run("acpsgd", "1d")["compiled"]).ops
  assert [op.kind for op in ops] == ["all-reduce", "all-reduce"]
  assert all(op.weight == 0.5 for op in ops)
  # Branch 0 (even steps) reduces the P factors, branch 1 (odd steps) the Q factors.
  assert {op.branch: op.buffer_bytes for op in ops} == {
      0: 4 * (view.p_size + view.dense.size), 1: 4 * (view.q_size + view.dense.size)}


def test_powersgd_two_allreduces():
  view = lowrank.MatrixView.of(PARAMS, RANK, 2.0)
  ops = wire.collective_bytes(_run("powersgd", "1d")["compiled"]).ops
  assert [(op.kind, op.buffer_bytes) for op in ops] == [
      ("all-reduce", 4 * (view.p_size + view.dense.size)), ("all-reduce", 4 * view.q_size)]


# ------------------------------------------------------------------ semantics


def test_matrix_view():
  view = lowrank.MatrixView.of(PARAMS, RANK, 2.0)
  assert view.groups == ((2, 16, 12), (1, 36, 8))
  assert view.p_size == 2 * (2 * 16 + 36) and view.q_size == 2 * (2 * 12 + 8)
  assert view.dense.size == 12 + 6
  # A higher bar sends the (36 x 8) conv dense: (36 + 8) * 2 * 3 > 288.
  assert lowrank.MatrixView.of(PARAMS, RANK, 3.3).groups == ((2, 16, 12),)


@pytest.mark.parametrize("factor", ["p", "q"])
def test_columns_pad_and_round_trip(factor):
  """Every leaf's factor columns are rows of one zero-padded batch, in bucket order."""
  view = lowrank.MatrixView.of(PARAMS, RANK, 2.0)
  size = view.p_size if factor == "p" else view.q_size
  flat = jnp.arange(1, size + 1, dtype=jnp.float32)
  length = view.length()
  columns = np.asarray(view.columns(flat, factor, length))
  assert columns.shape == (3, RANK, 36) and view.length("q") == 12
  leaves = [batch[i] for batch in (view.p_factors(flat) if factor == "p" else view.q_factors(flat))
            for i in range(batch.shape[0])]
  for row, leaf in zip(columns, leaves):
    n = leaf.shape[0]
    np.testing.assert_array_equal(row[:, :n], np.asarray(leaf).T)
    np.testing.assert_array_equal(row[:, n:], 0)
  np.testing.assert_array_equal(view.uncolumns(jnp.asarray(columns), factor), flat)
  np.testing.assert_array_equal(
      view.uncolumns(view.columns(flat, factor), factor), flat)


@pytest.mark.parametrize("factor", ["p", "q"])
def test_untransposed_reads_each_groups_transposed_factors(factor):
  """The groups' ``[count, r, n]`` factors, flat and end to end, give the flat factor
  buffer: each leaf's factor transposed back, leaves in bucket order."""
  view = lowrank.MatrixView.of(PARAMS, RANK, 2.0)
  size = view.p_size if factor == "p" else view.q_size
  flat = jnp.arange(1, size + 1, dtype=jnp.float32)
  batches = view.p_factors(flat) if factor == "p" else view.q_factors(flat)
  transposed = jnp.concatenate([jnp.swapaxes(b, 1, 2).reshape(-1) for b in batches])
  assert not np.array_equal(transposed, flat)  # the layouts differ, so the test can fail
  np.testing.assert_array_equal(view.untransposed(transposed, factor), flat)


def test_per_group_splits_rows_by_group():
  view = lowrank.MatrixView.of(PARAMS, RANK, 2.0)
  rows = jnp.arange(3 * RANK, dtype=jnp.float32).reshape(3, 1, RANK)
  pieces = view.per_group(rows)
  assert [p.shape for p in pieces] == [(2, 1, RANK), (1, 1, RANK)]
  np.testing.assert_array_equal(jnp.concatenate(pieces), rows)


@pytest.mark.parametrize("factor", ["p", "q"])
@pytest.mark.parametrize("values", [[2.0, 2.0, 8.0], [8.0, 2.0, 2.0], [1.0, 4.0, 1.0]])
def test_per_entry_gives_every_entry_its_groups_value(factor, values):
  tree = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(16, 12), (20, 12), (16, 12), (36, 8)]]
  view = lowrank.MatrixView.of(tree, RANK, 1.0)
  assert view.groups == ((2, 16, 12), (1, 20, 12), (1, 36, 8))
  expected = np.concatenate([
      np.full(g * (rows if factor == "p" else cols) * RANK, value, np.float32)
      for (g, rows, cols), value in zip(view.groups, values)])
  np.testing.assert_array_equal(view.per_entry(values, factor), expected)


@hypothesis.settings(deadline=None, max_examples=30)
@hypothesis.given(count=st.integers(1, 40))
def test_a_shape_of_many_leaves_is_batched_eight_leaves_at_most(count):
  """XLA:CPU fuses the concatenation of at most 8 leaves into the residual's addition."""
  tree = [jax.ShapeDtypeStruct((16, 12), jnp.float32)] * count + [
      jax.ShapeDtypeStruct((36, 8), jnp.float32), jax.ShapeDtypeStruct((12,), jnp.float32)]
  view = lowrank.MatrixView.of(tree, RANK, 2.0)
  counts = [g for g, rows, _ in view.groups if rows == 16]
  assert sum(counts) == count and len(counts) == -(-count // 8)
  assert max(counts) <= 8 and max(counts) - min(counts) <= 1
  assert view.groups[len(counts):] == ((1, 36, 8),)
  assert view.runs == tuple(counts) + (1, 1)
  assert view.lowrank.leaves == tuple(range(count + 1))


# Eleven leaves of one shape: two batches, of 6 and 5.
DEEP = {**{f"layer{i:02d}": jnp.zeros((16, 12)) for i in range(11)},
        "conv": jnp.zeros((3, 3, 4, 8)), "bias": jnp.zeros((12,))}
# params, compressed leaves, dense leaves
ORACLE_CASES = {
    "shallow": (PARAMS, COMPRESSED, ("dense.bias", "small")),
    "deep": (DEEP, tuple(k for k in DEEP if k != "bias"), ("bias",)),
}


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_powersgd_matches_numpy_oracle(case):
  params, compressed, dense = ORACLE_CASES[case]
  if params is PARAMS:
    run = _run("powersgd", "1d")
  else:
    run = harness.run_two_steps(FACTORIES["powersgd"], params, *MESHES["1d"])
    assert lowrank.MatrixView.of(params, RANK, 2.0).groups == (
        (6, 16, 12), (5, 16, 12), (1, 36, 8))
  grads, state0 = _np(run["grads"][0]), run["rows"][0]
  out, state1 = run["outs"][0], run["rows"][1]
  for path in compressed:
    m = [_matrix(_leaf(grads, path)[i]) for i in range(8)]
    q = _factor(np.asarray(state0.q[0]), path, "q", params)
    p_hat = _gram_schmidt(np.mean([mi @ q for mi in m], axis=0))
    local_q = [mi.T @ p_hat for mi in m]
    q_mean = np.mean(local_q, axis=0)
    np.testing.assert_allclose(
        _matrix(np.asarray(_leaf(out, path)[0])), p_hat @ q_mean.T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_factor(np.asarray(state1.q[0]), path, "q", params), q_mean,
                               rtol=1e-4, atol=1e-5)
    for i in (0, 5):
      np.testing.assert_allclose(
          _matrix(np.asarray(_leaf(state1.residual, path)[i])), m[i] - p_hat @ local_q[i].T,
          rtol=1e-4, atol=1e-5)
  for path in dense:
    np.testing.assert_allclose(np.asarray(_leaf(out, path)[0]),
                               _leaf(grads, path).mean(axis=0), rtol=1e-6, atol=1e-6)
    assert not np.asarray(_leaf(state1.residual, path)).any()


def test_acpsgd_matches_numpy_oracle_and_alternates():
  run = _run("acpsgd", "1d")
  states, outs = run["rows"], run["outs"]
  np.testing.assert_array_equal(states[1].q, states[0].q)  # step 0 sent P
  assert not np.array_equal(states[1].p, states[0].p)
  np.testing.assert_array_equal(states[2].p, states[1].p)  # step 1 sent Q
  assert not np.array_equal(states[2].q, states[1].q)
  for path in COMPRESSED:
    residual = [np.zeros_like(_matrix(np.asarray(_leaf(PARAMS, path))), np.float64)] * 8
    for step in (0, 1):
      g = _np(run["grads"][step])
      m = [_matrix(_leaf(g, path)[i]) + residual[i] for i in range(8)]
      p = _factor(np.asarray(states[step].p[0]), path, "p")
      q = _factor(np.asarray(states[step].q[0]), path, "q")
      if step == 0:
        local = [mi @ q for mi in m]
        sent = [x @ q.T for x in local]
        expected = np.mean(local, axis=0) @ q.T
        next_factor = _factor(np.asarray(states[1].p[0]), path, "p")
      else:
        local = [mi.T @ p for mi in m]
        sent = [p @ x.T for x in local]
        expected = p @ np.mean(local, axis=0).T
        next_factor = _factor(np.asarray(states[2].q[0]), path, "q")
      np.testing.assert_allclose(_matrix(np.asarray(_leaf(outs[step], path)[0])), expected,
                                 rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(next_factor, _gram_schmidt(np.mean(local, axis=0)),
                                 rtol=1e-4, atol=1e-5)
      residual = [mi - s for mi, s in zip(m, sent)]
      np.testing.assert_allclose(
          _matrix(np.asarray(_leaf(states[step + 1].residual, path)[3])), residual[3],
          rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FACTORIES)
def test_mass_conservation(name):
  run = _run(name, "1d")
  for step in (0, 1):
    before, after = run["rows"][step].residual, run["rows"][step + 1].residual
    corrected = jax.tree.map(lambda g, e: np.mean(np.asarray(g, np.float64) + e, axis=0),
                             run["grads"][step], _np(before))
    kept = jax.tree.map(lambda o, e: np.asarray(o[0], np.float64) + np.mean(e, axis=0),
                        run["outs"][step], _np(after))
    chex.assert_trees_all_close(kept, corrected, rtol=1e-5, atol=1e-5)


def test_powersgd_exact_on_rank_r_gradient():
  run = _run("powersgd", "1d")
  rng = np.random.default_rng(0)

  def rank_r(leaf):  # M_i = A B_i^T: a column space shared by every device
    rows, cols = _matrix(leaf).shape
    left = rng.normal(size=(rows, RANK))
    return np.stack([left @ rng.normal(size=(RANK, cols)) for _ in range(8)]).reshape(
        (8,) + leaf.shape).astype(np.float32)

  grads = jax.tree.map(rank_r, PARAMS)
  out, _ = run["fn"](training.shard(grads, run["mesh"], "data"), run["states"][0])
  for path in COMPRESSED:
    np.testing.assert_allclose(np.asarray(_leaf(out, path)[0]),
                               _leaf(grads, path).mean(axis=0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FACTORIES)
def test_zero_gradient_keeps_factors(name):
  run = _run(name, "1d")
  zeros = training.shard(jax.tree.map(lambda x: jnp.zeros((8,) + x.shape), PARAMS),
                         run["mesh"], "data")
  state = run["states"][1]
  out, new = run["fn"](zeros, state._replace(
      residual=jax.tree.map(jnp.zeros_like, state.residual)))
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(out))
  if name == "acpsgd":  # an odd step: Q is kept, then orthonormalised again
    np.testing.assert_array_equal(new.p, state.p)
    np.testing.assert_allclose(new.q, state.q, rtol=1e-6, atol=1e-6)
  elif name == "powersgd":
    np.testing.assert_array_equal(new.q, state.q)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new))


# Gradients whose largest entry is 1e38 (near f32's 3.4e38), 1e-30, or 1e10
# (PowerSGD's warm start once squared it): the old products and norms
# overflowed or underflowed there into a silent zero mean.
EXTREMES = {"1e38": 1e38, "1e-30": 1e-30, "1e10": 1e10}


def _extreme_gradients(seed, scale, identical):
  """Gaussian gradients scaled so the largest entry of each device's leaf is ``scale``."""
  grads = _per_device_normal(seed, devices=1 if identical else 8)

  def leaf(x):
    x = np.asarray(x, np.float64)
    x = x * (scale / np.abs(x).max(axis=tuple(range(1, x.ndim)), keepdims=True))
    return np.broadcast_to(x, (8,) + x.shape[1:]).astype(np.float32)

  return jax.tree.map(leaf, grads)


def _oracle_mean(name, step, m, state, path):
  """The float64 low-rank mean of one step of ``name`` from the state it started with.

  ``m``: every device's corrected matrix. PowerSGD's warm start enters only
  through the directions of its columns; ACP-SGD's factors are orthonormal.
  """
  if name == "acpsgd" and step % 2:
    p = _factor(np.asarray(state.p[0]), path, "p")
    return p @ np.mean([mi.T @ p for mi in m], axis=0).T
  q = _factor(np.asarray(state.q[0]), path, "q")
  if name == "acpsgd":
    return np.mean([mi @ q for mi in m], axis=0) @ q.T
  p_hat = _gram_schmidt(np.mean([mi @ q for mi in m], axis=0))
  return p_hat @ np.mean([mi.T @ p_hat for mi in m], axis=0).T


@pytest.mark.parametrize("identical", [True, False], ids=["identical", "per_device"])
@pytest.mark.parametrize("extreme", EXTREMES)
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_extreme_gradients_give_the_low_rank_mean(name, extreme, identical):
  """Three steps (PowerSGD's warm start, both of ACP-SGD's factors) against float64.

  f32 keeps its relative precision across its normal range, so the tolerance
  of the unit-scale oracle tests holds relative to the gradients' scale:
  ``rtol=1e-4``, ``atol=1e-5 * scale`` (the rounding of sums of a few dozen
  products and of a rank-2 Gram-Schmidt is near 1e-6 of the scale).
  """
  scale = EXTREMES[extreme]
  run = _run(name, "1d")
  state = run["states"][0]
  for step in range(3):
    grads = _extreme_gradients(10 + step, scale, identical)
    before = harness.state_rows(run["tx"], state, PARAMS)
    out, state = jax.block_until_ready(
        run["fn"](training.shard(grads, run["mesh"], "data"), state))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)), step
    for path in COMPRESSED:
      m = [_matrix(np.asarray(_leaf(grads, path)[i], np.float64)
                   + np.asarray(_leaf(before.residual, path)[i], np.float64))
           for i in range(8)]
      got = _matrix(np.asarray(_leaf(out, path)[0], np.float64))
      assert np.abs(got).max() > scale / 100, (step, path)  # not the silent zero
      np.testing.assert_allclose(got, _oracle_mean(name, step, m, before, path),
                                 rtol=1e-4, atol=1e-5 * scale, err_msg=f"{step} {path}")
    for path in ("dense.bias", "small"):
      np.testing.assert_allclose(np.asarray(_leaf(out, path)[0]),
                                 _leaf(grads, path).astype(np.float64).mean(axis=0),
                                 rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("scale", [2.0**100, 2.0**-100])
def test_orthonormalize_rows_near_1e30_and_1e_minus_30(scale):
  """Such rows come out orthonormal, as at unit scale up to rounding (their squared
  norms are out of f32's range: Inf gave zero rows, 0 unnormalised ones)."""
  x = jax.random.normal(jax.random.key(0), (3, 2, 36))
  want = np.asarray(jax.jit(lowrank._orthonormalize)(x))
  got = np.asarray(jax.jit(lowrank._orthonormalize)(x * scale))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------- arguments


@pytest.mark.parametrize("factory", [lowrank.powersgd, lowrank.acpsgd])
@pytest.mark.parametrize("kwargs, error, argument", [
    (dict(rank=0), ValueError, "`rank`"),
    (dict(rank=-3), ValueError, "`rank`"),
    (dict(rank=1.5), TypeError, "`rank`"),
    (dict(min_compression_rate=0.5), ValueError, "`min_compression_rate`"),
    (dict(min_compression_rate=float("nan")), ValueError, "`min_compression_rate`"),
    (dict(axis_name=3), TypeError, "`axis_name`"),
    (dict(axis_name=("x", 1)), TypeError, "`axis_name`"),
    (dict(axis_name=("x", "x")), ValueError, "`axis_name`"),
    (dict(axis_name=""), ValueError, "`axis_name`"),
    (dict(seed=-1), ValueError, "`seed`"),
    (dict(seed="0"), TypeError, "`seed`"),
])
def test_bad_arguments(factory, kwargs, error, argument):
  args = dict(rank=2, axis_name="data") | kwargs
  with pytest.raises(error, match=argument):
    factory(**args)


def test_bad_warm_start_and_mismatched_updates():
  with pytest.raises(TypeError, match="`warm_start`"):
    lowrank.powersgd(2, "data", warm_start=1)
  tx = lowrank.powersgd(2, "data")
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="shape"):
    tx.update({**PARAMS, "small": jnp.zeros((3, 3))}, state)


ALIKE = {f"w{i}": jnp.zeros((16, 12)) for i in range(4)}


@pytest.mark.parametrize("params, buckets, batches", [
    (ALIKE, 2, 1),
    ({**ALIKE, "long": jnp.zeros((400, 12))}, 3, 2),  # 400-row columns: a batch alone
], ids=["alike", "one_long"])
def test_acpsgd_orthonormalises_the_buckets_in_a_few_batches(params, buckets, batches,
                                                             xla_route):
  """After the last exchange, one Gram-Schmidt of ``r`` norms per batch of buckets whose
  columns are about as long, not one per bucket (PowerSGD's, which the next product
  waits for, is one per bucket)."""
  mesh = training.make_mesh(8)
  grads = training.stack_per_device(params, mesh, "data")

  def norms(tx):
    state = training.init_state(tx, params, mesh, "data")
    text = str(jax.make_jaxpr(training.make_update(tx, mesh, "data"))(grads, state))
    return text.count(" = sqrt ")

  tx = lowrank.acpsgd(RANK, "data", bucket_cap_mb=0.001)
  assert len(protocol.spec(tx).fused.plan(params)) == buckets
  assert norms(tx) == RANK * batches
  assert norms(lowrank.powersgd(RANK, "data", bucket_cap_mb=0.001)) == RANK * buckets


@pytest.mark.parametrize("factory", [lowrank.powersgd, lowrank.acpsgd])
def test_no_finiteness_pass_over_the_corrected_gradient(factory):
  """The factors are products of the gradient and carry a NaN by themselves: the
  compiled step reduces no gradient-sized buffer (only factors and norms)."""
  params = {f"w{i}": jnp.zeros((512, 512)) for i in range(4)}
  n = 4 * 512 * 512
  mesh = training.make_mesh(1)
  tx = factory(4, "data")
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  text = training.make_update(tx, mesh, "data").lower(grads, state).compile().as_text()
  reductions = [row for row in hlo_counts.count(text, n).heaviest
                if row[3].endswith("reduce_sum")]
  assert sum(row[0] for row in reductions) < 0.1, reductions


# Five matrices in three groups and a bias: 16,448 entries, 257 rows of 64, and every
# group's offset and columns a multiple of 64.
WIDE = {"a": jnp.zeros((64, 128)), **{f"b{i}": jnp.zeros((32, 64)) for i in range(3)},
        "c": jnp.zeros((16, 128)), "bias": jnp.zeros((64,))}


def test_the_residual_is_written_in_rows_in_place(xla_route):
  """On CPU the residual's groups (``[count, rows, cols]`` pieces of ``M - P Q^T``) are
  written over the old residual in place, in rows of 64 entries of it: the conditional
  that keeps the step takes the buffer as ``[n / 64, 64]``, and no kernel copies it."""
  if jax.default_backend() != "cpu":
    pytest.skip("the conditional and its rows are XLA:CPU's form")
  n = shapes.num_params(WIDE)
  mesh = training.make_mesh(1)
  for factory in (lowrank.powersgd, lowrank.acpsgd):
    tx = factory(4, "data")
    state = training.init_state(tx, WIDE, mesh, "data")
    grads = training.stack_per_device(WIDE, mesh, "data")
    text = training.make_update(tx, mesh, "data", donate=True).lower(
        grads, state).compile().as_text()
    writes = [line for line in text.splitlines() if "dynamic-update-slice(" in line]
    assert writes and all(f"f32[{n // 64},64]" in line for line in writes), writes
    copies = [line for line in text.splitlines()
              if " copy(" in line and (f"f32[{n}]" in line or f"f32[{n // 64},64]" in line)]
    assert not copies, copies


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_rows_write_the_residual_of_the_flat_write(name, monkeypatch, xla_route):
  """The residual, the factors and the mean after two steps on 8 devices, written in rows
  of 64 and, with rows of one entry, flat: the same values (within a float tolerance:
  the kernels that write them are other loops)."""
  rows = harness.run_two_steps(FACTORIES[name], WIDE, *MESHES["1d"])
  monkeypatch.setattr(fusion, "_ROW", 1)
  flat = harness.run_two_steps(FACTORIES[name], WIDE, *MESHES["1d"])
  for got, want in ((rows["outs"], flat["outs"]), (rows["states"][1:], flat["states"][1:])):
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
  assert np.asarray(rows["rows"][2].residual["a"]).any()


def test_row_width():
  """The largest power of two up to 64 that divides the length, the offsets and each
  piece's last dimension; 1 when no piece has two dimensions."""
  resnet = 25_557_032  # 8 times an odd number
  assert fusion._row_width(resnet, (0, 4096), [(1, 64, 64), (3, 512, 2048)]) == 8
  assert fusion._row_width(1 << 20, (0, 4096), [(1, 64, 64), (3, 512, 2048)]) == 64
  assert fusion._row_width(1 << 20, (0, 4096), [(1, 64, 64), (1, 2048, 1000)]) == 8
  assert fusion._row_width(1 << 20, (0, 4100), [(1, 64, 64), (3, 512, 2048)]) == 4
  assert fusion._row_width(1 << 20 | 1, (0, 4096), [(1, 64, 64)]) == 1
  assert fusion._row_width(1 << 20, (0, 4096), [(4096,), (512,)]) == 1


# Twelve matrices of three shapes and a bias: at 0.03 MiB, two buckets of two shapes each.
MANY = {**{f"a{i}": jnp.zeros((40, 24)) for i in range(5)},
        **{f"b{i}": jnp.zeros((3, 3, 8, 16)) for i in range(5)},
        "c0": jnp.zeros((64, 32)), "c1": jnp.zeros((64, 32)), "bias": jnp.zeros((24,))}


def _within(got, want, k=1024):
  """Each leaf of ``got`` within ``k`` float32 eps of its largest ``|want|`` (golden's
  rule for the low-rank methods: the two routes sum in other orders)."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    if not np.issubdtype(w.dtype, np.floating):
      np.testing.assert_array_equal(g, w)
      continue
    bound = k * np.finfo(np.float32).eps * np.max(np.abs(w), initial=0.0)
    assert np.max(np.abs(g - w), initial=0.0) <= bound, (np.max(np.abs(g - w)), bound)


@harness.needs_native
@pytest.mark.parametrize("name", ["powersgd", "powersgd_cold", "acpsgd"])
@pytest.mark.parametrize("mesh_name", ["1d", "2x4"])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.03])
def test_the_custom_calls_give_the_xla_route_s_steps(name, mesh_name, bucket_cap_mb,
                                                       monkeypatch):
  """Two steps on 8 devices (ring and torus, one bucket and two), the products,
  orthonormalisations and residual by the custom calls and by XLA: the means and every
  device's state agree within the golden file's tolerance."""
  config = dict(warm_start=False) if name == "powersgd_cold" else {}
  factory = getattr(lowrank, name.split("_")[0])

  def run():
    return harness.run_two_steps(
        lambda axis: factory(RANK, axis, bucket_cap_mb=bucket_cap_mb, **config), MANY,
        *MESHES[mesh_name])

  by_calls = run()
  text = by_calls["compiled"].as_text()
  assert "jaxcomp_lowrank_product" in text and " dot(" not in text
  monkeypatch.setattr(lowrank, "_native", lambda view: False)
  by_xla = run()
  assert "jaxcomp_lowrank_product" not in by_xla["compiled"].as_text()
  _within(by_calls["outs"], by_xla["outs"])
  _within(by_calls["rows"][1:], by_xla["rows"][1:])
  assert np.asarray(by_calls["rows"][2].residual["a0"]).any()


@harness.needs_native
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.03])
def test_the_calls_reading_the_leaves_give_the_bits_of_the_corrected_runs(name, bucket_cap_mb,
                                                                         monkeypatch):
  """Two steps on 8 devices with the products and the residual formed from the leaves
  and the residual where they lie, and with error feedback's runs written first: the
  same sums of the same entries, so the same means and states bit for bit; the first
  writes no corrected gradient (no `jaxcomp_corrected` call)."""
  factory = getattr(lowrank, name)

  def run():
    return harness.run_two_steps(lambda axis: factory(RANK, axis, bucket_cap_mb=bucket_cap_mb),
                                 MANY, *MESHES["1d"])

  from_leaves = run()
  text = from_leaves["compiled"].as_text()
  assert "jaxcomp_corrected" not in text and "jaxcomp_lowrank_product" in text
  monkeypatch.setattr(lowrank, "_prepare_leaves", lambda rank, rate: None)
  from_runs = run()
  assert "jaxcomp_corrected" in from_runs["compiled"].as_text()
  chex.assert_trees_all_equal(from_leaves["outs"], from_runs["outs"])
  chex.assert_trees_all_equal(from_leaves["rows"], from_runs["rows"])
  assert np.asarray(from_leaves["rows"][2].residual["a0"]).any()


@harness.needs_native
@pytest.mark.parametrize("factory, form, calls", [
    # (products, factor columns, residuals) per bucket
    (lowrank.powersgd, None, (2, 2, 1)),
    (lowrank.acpsgd, 0, (1, 1, 1)),
    (lowrank.acpsgd, 1, (1, 1, 1)),
    (lowrank.acpsgd, None, (2, 2, 1)),  # both forms in one program: a branch each
])
def test_on_cpu_a_bucket_is_a_few_custom_calls_and_its_residual_is_written_in_place(
    factory, form, calls):
  """Each bucket's products, factor columns and residual are one custom call each (the
  P step renews P alone, the Q step Q alone), the residual's call writes over the donated
  residual (it aliases it), and no kernel copies a residual."""
  mesh = training.make_mesh(1)
  build = functools.partial(factory, RANK, "data", bucket_cap_mb=0.03)
  buckets = protocol.spec(build()).fused.plan(MANY)
  assert len(buckets) == 2
  tx = build() if form is None else bench_compression.in_form(build, form)
  state = training.init_state(tx, MANY, mesh, "data")
  grads = training.stack_per_device(MANY, mesh, "data")
  update = training.make_update(tx, mesh, "data", donate=True)
  text = update.lower(grads, state).compile().as_text()
  targets = ("jaxcomp_lowrank_product", "jaxcomp_factor_columns", "jaxcomp_lowrank_residual")
  assert tuple(text.count(f'custom_call_target="{t}"') for t in targets) == tuple(
      2 * c for c in calls)
  residual_calls = [line for line in text.splitlines()
                    if 'custom_call_target="jaxcomp_lowrank_residual"' in line]
  assert all("output_to_operand_aliasing={{}: (0, {})}" in line for line in residual_calls)
  sizes = {b.size for b in buckets}
  copies = [line for line in text.splitlines()
            if " copy(" in line and any(f"f32[{n}]" in line for n in sizes)]
  assert not copies, copies
