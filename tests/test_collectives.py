"""Collectives against their numpy oracles (tests/harness.py), on 8 fake devices."""

from fractions import Fraction
import functools
import math

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jaxcomp
from jaxcomp import collectives
from jaxcomp import training
from jaxcomp import wire
from jaxcomp._src import backward
from jaxcomp._src import collectives as collectives_src
import harness

EMPTY = collectives.EMPTY_INDEX


def _local_topk_blocks(num_devices, n, k, seed):
  rng = np.random.default_rng(seed)
  dense = rng.standard_normal((num_devices, n)).astype(np.float32)
  # Shared coordinates make partners sum entries, exercising the merge.
  dense[:, :3] += 4.0
  indices = np.stack([harness.np_topk(row, k) for row in dense]).astype(np.int32)
  values = np.take_along_axis(dense, indices, axis=1)
  return values, indices


def _integers(shape, seed):
  """Integer-valued f32: every partial sum is exact, so any summation order is bitwise equal."""
  return np.random.default_rng(seed).integers(-1000, 1000, shape).astype(np.float32)


def _per_device(fn, mesh, spec, out_specs=None):
  """jit(shard_map) of ``fn`` on this device's row, rows stacked back."""
  return jax.jit(jax.shard_map(
      lambda *xs: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in xs))),
      mesh=mesh, in_specs=spec, out_specs=spec if out_specs is None else out_specs,
      check_vma=False))


# ------------------------------------------------------------------ gTop-k


@pytest.mark.parametrize("num_devices", [2, 3, 4, 5, 6, 7, 8])
def test_gtopk_allreduce_equals_numpy_butterfly(num_devices):
  k = 6
  values, indices = _local_topk_blocks(num_devices, 64, k, seed=num_devices)
  out_v, out_i = harness.gtopk_allreduce_fn(num_devices, k)(values, indices)
  ref_v, ref_i = harness.gtopk_allreduce_reference(list(zip(values, indices)), k)
  for d in range(num_devices):
    harness.assert_bitwise_equal(out_i[d], ref_i)
    harness.assert_bitwise_equal(out_v[d], ref_v)


def test_gtopk_allreduce_on_two_devices_is_exact_topk_of_the_sum():
  k = 6
  values, indices = _local_topk_blocks(2, 64, k, seed=7)
  dense = harness.densify_reference(values, indices, 64)
  out_v, out_i = harness.gtopk_allreduce_fn(2, k)(values, indices)
  np.testing.assert_array_equal(np.asarray(out_i[0]), harness.np_topk(dense, k))
  harness.assert_bitwise_equal(out_v[0], dense[harness.np_topk(dense, k)])


@pytest.mark.parametrize("num_devices", [2, 3, 4, 5, 6, 7, 8])
def test_gtopk_allreduce_bytes_equal_the_formula(num_devices):
  """``log2(P)`` rounds of ``8 k`` bytes; two more (fold, send-back) when P is no power of two."""
  k = 6
  values, indices = _local_topk_blocks(num_devices, 64, k, seed=0)
  compiled = harness.gtopk_allreduce_fn(num_devices, k).lower(values, indices).compile()
  sent = wire.collective_bytes(compiled)
  power = 1 << (num_devices.bit_length() - 1)
  rounds = int(math.log2(power)) + (2 if power != num_devices else 0)
  assert sent.total == rounds * 8 * k
  assert set(sent.by_kind) == {"collective-permute"}
  assert sum(t.bytes for t in wire.gtopk(k, num_devices)) == sent.total


@hypothesis.given(
    seed=st.integers(0, 2**16),
    overlap=st.sampled_from([0, 2, 5]),
)
def test_merge_topk_matches_reference_and_is_symmetric(seed, overlap):
  k = 5
  rng = np.random.default_rng(seed)
  ia = rng.choice(40, k, replace=False).astype(np.int32)
  ib = rng.choice(40, k, replace=False).astype(np.int32)
  ib[:overlap] = ia[:overlap]
  ib = np.unique(ib)
  ib = np.concatenate([ib, np.full(k - ib.size, EMPTY, np.int32)])
  # Values drawn from a few levels make magnitude ties common.
  va = rng.choice([-2.0, -1.0, 0.5, 1.0, 3.0], k).astype(np.float32)
  vb = np.where(ib == EMPTY, 0, rng.choice([-1.0, 1.0, 2.0], k)).astype(np.float32)
  merge = jax.jit(collectives.merge_topk, static_argnums=4)
  ab = merge(va, ia, vb, ib, k)
  ba = merge(vb, ib, va, ia, k)
  ref = harness.merge_topk_reference(va, ia, vb, ib, k)
  chex.assert_trees_all_equal(tuple(map(np.asarray, ab)), tuple(map(np.asarray, ba)))
  harness.assert_bitwise_equal(ab[1], ref[1])
  harness.assert_bitwise_equal(ab[0], ref[0])


def test_merge_topk_ranks_nan_first():
  """A NaN (the poison) survives every merge: it ranks above any magnitude."""
  k = 2
  va, ia = np.array([np.nan, 1.0], np.float32), np.array([4, 5], np.int32)
  vb, ib = np.array([7.0, 3.0], np.float32), np.array([6, 8], np.int32)
  got = jax.jit(collectives.merge_topk, static_argnums=4)(va, ia, vb, ib, k)
  ref = harness.merge_topk_reference(va, ia, vb, ib, k)
  np.testing.assert_array_equal(np.asarray(got[1]), ref[1])
  np.testing.assert_array_equal(ref[1], [4, 6])
  harness.assert_bitwise_equal(got[0], ref[0])


# ------------------------------------------------------------------ dense sums


@functools.lru_cache(maxsize=None)
def _torus_fn(shape, names):
  return _per_device(lambda x: collectives.torus_allreduce(x, *names),
                     training.make_mesh(shape, names), P(names))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("leaf_shape", [(16,), (5, 7)], ids=["even", "uneven"])
def test_torus_allreduce_equals_the_sum_and_runs_the_torus(shape, leaf_shape):
  names = ("x", "y")
  x = _integers((8, *leaf_shape), seed=sum(leaf_shape))
  torus = _torus_fn(shape, names)
  got = np.asarray(torus(x))
  want = harness.reduce_sum_reference(x)
  for d in range(8):
    harness.assert_bitwise_equal(got[d], want)
  sent = wire.collective_bytes(torus.lower(x).compile())
  rows, cols = shape
  formula = wire.torus_allreduce(math.prod(leaf_shape), rows, cols)
  assert set(sent.by_kind) == {"reduce-scatter", "all-reduce", "all-gather"}
  assert sent.total == sum(t.bytes for t in formula)
  assert [op.group_size for op in sent.ops] == [rows, cols, rows]


@pytest.mark.parametrize("axes", [("data",), ("x", "y")], ids=["ring", "torus"])
def test_reduce_sum_and_mean_equal_their_oracles(axes):
  shape = 8 if len(axes) == 1 else (2, 4)
  mesh = training.make_mesh(shape, axes)
  axis = harness.axis_of(axes)
  x = _integers((8, 5, 7), seed=3) * 8  # x / 8 is exact too
  fn = _per_device(lambda x: (collectives.reduce_sum(x, axis), collectives.mean(x, axis)),
                   mesh, P(axes), (P(axes), P(axes)))
  total, mean = fn(x)
  for d in range(8):
    harness.assert_bitwise_equal(total[d], harness.reduce_sum_reference(x))
    harness.assert_bitwise_equal(mean[d], harness.mean_reference(x))
  sent = wire.collective_bytes(fn.lower(x).compile())
  sizes = (8,) if len(axes) == 1 else (2, 4)
  one = wire.mean(35, sizes)
  assert sent.total == 2 * sum(t.bytes for t in one)


@pytest.mark.parametrize("wire_dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_mean_equals_its_oracle(wire_dtype):
  """Each device's ``x / P`` rounded to 16 bits, summed in f32, rounded again."""
  mesh = training.make_mesh(8)
  # Few significant bits and a narrow range: every f32 partial sum is exact.
  x = (_integers((8, 37), seed=5) / 64).astype(np.float32)
  fn = _per_device(lambda x: collectives.mean(x, "data", wire_dtype=wire_dtype), mesh, P("data"))
  got = np.asarray(fn(x))
  want = harness.mean_reference(x, wire_dtype)
  assert not np.array_equal(want, harness.mean_reference(x))  # the rounding shows
  for d in range(8):
    harness.assert_bitwise_equal(got[d], want)
  sent = wire.collective_bytes(fn.lower(x).compile())
  assert sent.by_kind == {t.kind: t.bytes for t in wire.mean(37, (8,), wire_dtype=wire_dtype)}
  # 37 elements padded to 40, 2 bytes each, 7/8 of them sent twice.
  assert sent.total == Fraction(2 * 7 * 2 * 40, 8)


@hypothesis.given(st.integers(1, 9), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_received_rows_are_summed_in_device_order(devices, width, seed):
  """Magnitudes over 30 binades: a sum in another order rounds differently."""
  rng = np.random.default_rng(seed)
  rows = (rng.normal(size=(devices, width))
          * 2.0 ** rng.integers(-15, 15, size=(devices, width))).astype(np.float32)
  harness.assert_bitwise_equal(jax.jit(collectives_src.sum_rows)(rows),
                               harness.sum_rows_reference(rows))


def test_the_order_of_the_rows_shows_in_the_sum():
  """Rows whose sum in order differs from a pairwise one, so the test above can fail."""
  rows = np.array([[1e8], [1.0], [-1e8], [1.0]], np.float32)
  assert harness.sum_rows_reference(rows)[0] == 1.0
  assert ((rows[0] + rows[1]) + (rows[2] + rows[3]))[0] == 0.0
  harness.assert_bitwise_equal(jax.jit(collectives_src.sum_rows)(rows), np.float32([1.0]))


def _sums_over_devices(jaxpr, devices: int, size: int) -> int:
  """The ``reduce_sum``s of ``jaxpr`` (nested jaxprs included) over the leading axis of a
  ``[devices, ...]`` operand of at least ``size`` entries."""
  found = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "reduce_sum" and 0 in eqn.params["axes"]:
      shape = eqn.invars[0].aval.shape
      found += bool(shape) and shape[0] == devices and math.prod(shape) >= size
    found += sum(_sums_over_devices(inner, devices, size) for inner in backward.sub_jaxprs(eqn))
  return found


_SUMMING_RECEIVED_ROWS = {
    "cast": lambda axis: jaxcomp.cast(jnp.bfloat16, axis),
    "signsgd": lambda axis: jaxcomp.signsgd(axis),
    "signsgd_majority": lambda axis: jaxcomp.signsgd(axis, majority_vote=True),
    "qsgd": lambda axis: jaxcomp.qsgd(8, axis),
    "int8": lambda axis: jaxcomp.quantized(8, axis),
    "int4": lambda axis: jaxcomp.quantized(4, axis),
}


@pytest.mark.parametrize("name", _SUMMING_RECEIVED_ROWS)
def test_the_rows_the_devices_sent_are_added_not_reduced(name):
  """A gradient's worth of rows received from 8 devices is summed by
  :func:`jaxcomp._src.collectives.sum_rows` (a chain of additions), not by a reduction
  over the device axis (XLA:CPU's is several times slower, see its docstring)."""
  params = {"w": jnp.zeros((64, 64))}
  mesh = training.make_mesh(8)
  tx = _SUMMING_RECEIVED_ROWS[name]("data")
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  jaxpr = jax.make_jaxpr(training.make_update(tx, mesh, "data"))(grads, state).jaxpr
  assert _sums_over_devices(jaxpr, 8, 64 * 64) == 0


def test_mean_scales_before_the_sum():
  """Eight gradients near the f32 maximum: their sum overflows, their mean does not."""
  mesh = training.make_mesh(8)
  x = np.full((8, 4), 3 * 2.0**126, np.float32)  # 2.6e38, few significant bits: exact sums
  fn = _per_device(lambda x: (collectives.reduce_sum(x, "data"), collectives.mean(x, "data")),
                   mesh, P("data"), (P("data"), P("data")))
  total, mean = fn(x)
  assert np.all(np.isinf(np.asarray(total)))
  harness.assert_bitwise_equal(mean, x)
  harness.assert_bitwise_equal(mean[0], harness.mean_reference(x))


# ------------------------------------------------------------------ sparse payloads


def test_sparse_allgather_gives_every_devices_pair():
  mesh = training.make_mesh(8)
  rng = np.random.default_rng(0)
  values = rng.standard_normal((8, 3)).astype(np.float32)
  indices = rng.choice(50, (8, 3)).astype(np.int32)
  spec = (P("data"), P("data"))
  fn = _per_device(lambda v, i: collectives.sparse_allgather(v, i, "data"), mesh, spec)
  got_v, got_i = fn(values, indices)
  want_v, want_i = harness.sparse_allgather_reference(values, indices)
  for d in range(8):
    harness.assert_bitwise_equal(got_v[d], want_v)
    harness.assert_bitwise_equal(got_i[d], want_i)
  sent = wire.collective_bytes(fn.lower(values, indices).compile())
  assert sent.total == 7 * 3 * 8 == sum(t.bytes for t in wire.sparse_allgather(3, 8))


@pytest.mark.parametrize("axes", [("data",), ("x", "y")], ids=["ring", "torus"])
def test_allgather_gives_every_devices_message_in_device_order(axes):
  """Byte messages (what signSGD and QSGD send), over one axis or the whole 2D mesh."""
  mesh = training.make_mesh(8 if len(axes) == 1 else (2, 4), axes)
  messages = np.random.default_rng(1).integers(0, 256, (8, 5)).astype(np.uint8)
  fn = _per_device(lambda m: collectives.allgather(m, harness.axis_of(axes)), mesh, P(axes))
  got = np.asarray(fn(messages))
  for d in range(8):
    harness.assert_bitwise_equal(got[d], harness.allgather_reference(messages))
  sent = wire.collective_bytes(fn.lower(messages).compile())
  assert sent.total == 7 * 5 == sum(t.bytes for t in wire.allgather(5, 8))


def test_densify_equals_its_oracle():
  values = np.array([[1.0, 2.0, 0.5], [3.0, 4.0, -1.0]], np.float32)
  indices = np.array([[0, EMPTY, 3], [0, 3, 1]], np.int32)
  got = np.asarray(collectives.densify(jnp.asarray(values), jnp.asarray(indices), 4))
  want = harness.densify_reference(values, indices, 4)
  np.testing.assert_array_equal(want, [4.0, -1.0, 0.0, 4.5])
  harness.assert_bitwise_equal(got, want)


def test_densify_drops_an_index_outside_the_vector():
  """A negative index is dropped like one past the end, not counted from the end."""
  values = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
  indices = np.array([-1, 4, 2, -4], np.int32)
  got = np.asarray(collectives.densify(jnp.asarray(values), jnp.asarray(indices), 4))
  np.testing.assert_array_equal(got, [0.0, 0.0, 4.0, 0.0])
  harness.assert_bitwise_equal(got, harness.densify_reference(values, indices, 4))


def test_densify_is_the_plain_sum_whatever_the_first_entry():
  """Zeros under the sum (+0.0) whatever the first entry is, NaN and infinities
  included: a non-finite entry reaches its own index only."""
  indices = jnp.asarray([2, 0, EMPTY], jnp.int32)
  for values in ([np.inf, 1.0, 0.0], [np.nan, 1.0, 0.0], [-3.0, np.inf, 0.0],
                 [-3.0, 1.0, np.nan], [-3.0, 1.0, 0.0]):
    values = np.asarray(values, np.float32)
    got = np.asarray(collectives.densify(jnp.asarray(values), indices, 4))
    # NaN where the oracle has NaN (its sign bit is the CPU's: not compared).
    np.testing.assert_array_equal(got, harness.densify_reference(values, np.asarray(indices), 4))
    np.testing.assert_array_equal(got[[1, 3]], [0.0, 0.0])
    assert not np.signbit(got[[1, 3]]).any()  # +0.0, as a buffer of zeros holds


def _ancestors(jaxpr, var, platform="cpu"):
  """The variables of ``jaxpr`` that ``var`` is computed from; through a
  ``lax.platform_dependent`` choice, from what ``platform``'s branch reads (the
  default branch where none names it)."""
  producers = {out: e for e in jaxpr.eqns for out in e.outvars}
  pending, found = [var], set()
  while pending:
    var = pending.pop()
    if not isinstance(var, jex_core.Var) or var in found:
      continue
    found.add(var)
    eqn = producers.get(var)
    if eqn is None:
      continue
    if "branches_platforms" in eqn.params:
      branches = dict(zip(eqn.params["branches_platforms"], eqn.params["branches"]))
      branch = next((b for on, b in branches.items() if on and platform in on), branches[None])
      position = eqn.outvars.index(var)
      inside = _ancestors(branch.jaxpr, branch.jaxpr.outvars[position], platform)
      pending.extend(outer for inner, outer in zip(branch.jaxpr.invars, eqn.invars[1:])
                     if inner in inside)
    else:
      pending.extend(eqn.invars)
  return found


def test_densify_forms_its_zeros_from_the_entries_on_cpu():
  """On CPU the buffer under the scatter is computed from the entries (so XLA
  makes it after they arrive, in memory freed by then), not from a constant."""
  jaxpr = jax.make_jaxpr(lambda v, i: collectives.densify(v, i, 16))(
      jnp.ones(4), jnp.arange(4, dtype=jnp.int32)).jaxpr
  (scatter,) = [e for e in jaxpr.eqns if e.primitive.name == "scatter-add"]
  assert jaxpr.invars[0] in _ancestors(jaxpr, scatter.invars[0])
  assert jaxpr.invars[0] not in _ancestors(jaxpr, scatter.invars[0], platform="cuda")


def test_unbound_axis_is_a_clear_error():
  with pytest.raises(ValueError, match="`axis_name` 'nope' is not a bound mesh axis"):
    jax.jit(lambda x: collectives.mean(x, "nope")).lower(jnp.ones(3))
