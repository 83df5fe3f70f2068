"""Collectives against psum and against a plain numpy butterfly, on 8 fake devices."""

import functools

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxcomp import collectives
from jaxcomp import training
from jaxcomp import wire

EMPTY = collectives.EMPTY_INDEX


def merge_reference(va, ia, vb, ib, k):
  """The spec of a merge: sum at equal indices, keep the k largest |v|, ties to the lower index."""
  sums = {}
  for v, i in zip(np.concatenate([va, vb]), np.concatenate([ia, ib])):
    if i == EMPTY:
      continue
    sums[int(i)] = np.float32(sums[int(i)] + v) if int(i) in sums else np.float32(v)
  ranked = sorted(sums.items(), key=lambda e: (-abs(e[1]), e[0]))[:k]
  ranked += [(EMPTY, np.float32(0))] * (k - len(ranked))
  return (
      np.array([v for _, v in ranked], np.float32),
      np.array([i for i, _ in ranked], np.int32),
  )


def gtopk_allreduce_reference(blocks, k):
  """The butterfly over per-device ``(values, indices)`` blocks, in numpy."""
  state = list(blocks)
  size = len(state)
  power = 1 << (size.bit_length() - 1)
  for j in range(size - power):
    state[j] = merge_reference(*state[j], *state[power + j], k)
  distance = 1
  while distance < power:
    state = [merge_reference(*state[i], *state[i ^ distance], k) for i in range(power)]
    distance *= 2
  return state[0]


def _local_topk_blocks(num_devices, n, k, seed):
  rng = np.random.default_rng(seed)
  dense = rng.standard_normal((num_devices, n)).astype(np.float32)
  # Shared coordinates make partners sum entries, exercising the merge.
  dense[:, :3] += 4.0
  indices = np.argsort(-np.abs(dense), axis=1, kind="stable")[:, :k].astype(np.int32)
  values = np.take_along_axis(dense, indices, axis=1)
  return values, indices


@functools.lru_cache(maxsize=None)
def _gtopk_fn(num_devices, k):
  mesh = training.make_mesh(num_devices)

  def per_device(values, indices):
    v, i = collectives.gtopk_allreduce(values[0], indices[0], k, "data")
    return v[None], i[None]

  spec = P("data")
  return jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
      check_vma=False))


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_gtopk_allreduce_equals_numpy_butterfly(num_devices):
  k = 6
  values, indices = _local_topk_blocks(num_devices, 64, k, seed=num_devices)
  out_v, out_i = _gtopk_fn(num_devices, k)(values, indices)
  ref_v, ref_i = gtopk_allreduce_reference(list(zip(values, indices)), k)
  for d in range(num_devices):
    np.testing.assert_array_equal(np.asarray(out_i[d]), ref_i)
    np.testing.assert_array_equal(np.asarray(out_v[d]), ref_v)


def test_gtopk_allreduce_on_two_devices_is_exact_topk_of_the_sum():
  k = 6
  values, indices = _local_topk_blocks(2, 64, k, seed=7)
  dense = np.zeros(64, np.float32)
  for v, i in zip(values, indices):
    np.add.at(dense, i, v)
  out_v, out_i = _gtopk_fn(2, k)(values, indices)
  top = np.argsort(-np.abs(dense), kind="stable")[:k]
  assert set(np.asarray(out_i[0]).tolist()) == set(top.tolist())
  np.testing.assert_array_equal(np.asarray(out_v[0]), dense[np.asarray(out_i[0])])


@pytest.mark.parametrize("num_devices", [3, 5, 6, 7])
def test_gtopk_allreduce_other_device_counts_agree_bitwise(num_devices):
  k = 5
  values, indices = _local_topk_blocks(num_devices, 48, k, seed=num_devices)
  out_v, out_i = _gtopk_fn(num_devices, k)(values, indices)
  ref_v, ref_i = gtopk_allreduce_reference(list(zip(values, indices)), k)
  for d in range(num_devices):
    np.testing.assert_array_equal(np.asarray(out_v[d]), ref_v)
    np.testing.assert_array_equal(np.asarray(out_i[d]), ref_i)


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_gtopk_allreduce_sends_log2p_times_8k_bytes(num_devices):
  k = 6
  values, indices = _local_topk_blocks(num_devices, 64, k, seed=0)
  compiled = _gtopk_fn(num_devices, k).lower(values, indices).compile()
  sent = wire.collective_bytes(compiled)
  rounds = num_devices.bit_length() - 1
  assert sent.total == rounds * 8 * k
  assert set(sent.by_kind) == {"collective-permute"}
  assert sum(t.bytes for t in collectives.gtopk_allreduce_bytes(k, num_devices)) == sent.total


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
  ref = merge_reference(va, ia, vb, ib, k)
  chex.assert_trees_all_equal(tuple(map(np.asarray, ab)), tuple(map(np.asarray, ba)))
  np.testing.assert_array_equal(np.asarray(ab[1]), ref[1])
  np.testing.assert_array_equal(np.asarray(ab[0]), ref[0])


def _torus_fn(shape, names):
  mesh = training.make_mesh(shape, names)
  spec = P(names)
  return jax.jit(jax.shard_map(
      lambda x: collectives.torus_allreduce(x[0], *names)[None],
      mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("leaf_shape", [(16,), (5, 7)], ids=["even", "uneven"])
def test_torus_allreduce_equals_psum(shape, leaf_shape):
  names = ("x", "y")
  x = jax.random.normal(jax.random.key(1), (8, *leaf_shape))
  torus = _torus_fn(shape, names)
  mesh = training.make_mesh(shape, names)
  psum = jax.jit(jax.shard_map(
      lambda x: lax.psum(x[0], names)[None], mesh=mesh, in_specs=P(names),
      out_specs=P(names), check_vma=False))
  got, want = torus(x), psum(x)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
  for d in range(1, 8):
    np.testing.assert_array_equal(np.asarray(got[d]), np.asarray(got[0]))
  sent = wire.collective_bytes(torus.lower(x).compile())
  rows, cols = shape
  formula = collectives.torus_allreduce_bytes(int(np.prod(leaf_shape)), rows, cols)
  assert set(sent.by_kind) == {"reduce-scatter", "all-reduce", "all-gather"}
  assert sent.total == sum(t.bytes for t in formula)
  assert [op.group_size for op in sent.ops] == [rows, cols, rows]


def test_sparse_allgather_gives_every_devices_pair():
  mesh = training.make_mesh(8)
  values = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  indices = jnp.arange(8 * 3, dtype=jnp.int32).reshape(8, 3) * 2
  fn = jax.jit(jax.shard_map(
      lambda v, i: tuple(a[None] for a in collectives.sparse_allgather(v[0], i[0], "data")),
      mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data")),
      check_vma=False))
  got_v, got_i = fn(values, indices)
  for d in range(8):
    np.testing.assert_array_equal(np.asarray(got_v[d]), np.asarray(values))
    np.testing.assert_array_equal(np.asarray(got_i[d]), np.asarray(indices))
  sent = wire.collective_bytes(fn.lower(values, indices).compile())
  assert sent.total == 7 * 3 * 8 == sum(t.bytes for t in collectives.sparse_allgather_bytes(3, 8))


def test_densify_drops_empty_slots_and_sums_repeats():
  values = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  indices = jnp.array([[0, EMPTY], [0, 3]], jnp.int32)
  np.testing.assert_array_equal(
      np.asarray(collectives.densify(values, indices, 4)), [4.0, 0.0, 0.0, 4.0])


def test_unbound_axis_is_a_clear_error():
  with pytest.raises(ValueError, match="`axis_name` 'nope' is not a bound mesh axis"):
    jax.jit(lambda x: collectives.mean(x, "nope")).lower(jnp.ones(3))
