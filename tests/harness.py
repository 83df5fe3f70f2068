"""Helpers that several test modules share (8 fake CPU devices, see conftest.py).

Beside the step builders, the plain-numpy oracles: one per collective and per
selection the compressors are built from. Each is the spec; the tests compare
the library to it exactly (bit for bit wherever the summation order cannot
matter, which the tests arrange with integer-valued or power-of-two data).
"""

import collections
import functools
import os
import pathlib

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import numpy as np
import pytest

from experiments import hlo_counts
import jaxcomp
from jaxcomp import collectives
from jaxcomp import protocol
from jaxcomp import training
from jaxcomp import wire
from jaxcomp._src import draws
from jaxcomp._src import native

EMPTY = collectives.EMPTY_INDEX


# Skips a test where the native custom calls could not be built here (no compiler).
needs_native = pytest.mark.skipif(
    not native.available(), reason=f"no native custom calls here: {native.unavailable_reason()}")

# Both routes of ``selection.Tuning.native``, the native one skipped where it cannot run.
NATIVE_ROUTES = [pytest.param(True, marks=needs_native), False]


def fresh_process_env() -> dict:
  """The environment of a fresh process a test starts: on CPU, and importing the
  ``jaxcomp`` this process tests (its checkout first on ``PYTHONPATH``), not whichever
  one the interpreter would find from the script's own directory."""
  checkout = str(pathlib.Path(jaxcomp.__file__).resolve().parents[1])
  path = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


class Clipped:
  """A user's own transformation holding another (it clips the updates first):
  a class with ``init`` and ``update``, not one that optax built."""

  def __init__(self, inner, limit):
    self.inner = inner
    self.limit = limit

  def init(self, params):
    return self.inner.init(params)

  def update(self, updates, state, params=None):
    updates = jax.tree.map(lambda g: jnp.clip(g, -self.limit, self.limit), updates)
    return self.inner.update(updates, state, params)


def axis_of(names):
  """The ``axis_name`` of a mesh's axis names: one name, or the pair."""
  return names[0] if len(names) == 1 else names


def per_device_normal(params, seed, devices=8):
  """Gaussian gradients shaped like ``params``, with a leading device axis."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      jax.random.normal(k, (devices,) + x.shape) for k, x in zip(keys, leaves)
  ])


def step_fn(tx, mesh, axis="data", max_traces=None):
  """jit(shard_map(update)) over stacked per-device gradients and state."""
  wrap = None if max_traces is None else (lambda f: chex.assert_max_traces(f, n=max_traces))
  return training.make_update(tx, mesh, axis, wrap=wrap)


def compiled_bytes_on_a_ring(tx, params, grads, num):
  """The bytes of ``tx.update``'s program on a ring of ``num`` devices, checked by kind
  against :func:`jaxcomp.wire.expected_bytes` (``grads``: one row per device)."""
  mesh = training.make_mesh(num)
  state = training.init_state(tx, params, mesh, "data")
  got = wire.collective_bytes(step_fn(tx, mesh).lower(grads, state).compile())
  assert got.by_kind == wire.expected_bytes(tx, params, num).by_kind
  return got


def run_two_steps(make_tx, params, mesh_shape, axis_names):
  """Two steps of ``make_tx(axis)`` on a mesh; everything the tests read, compiled once.

  ``states`` as the steps take them, ``rows`` the same with each device's
  state on its own row (:func:`state_rows`).
  """
  axis = axis_of(axis_names)
  mesh = training.make_mesh(mesh_shape, axis_names)
  tx = make_tx(axis)
  fn = step_fn(tx, mesh, axis)
  states = [training.init_state(tx, params, mesh, axis)]
  grads = [training.shard(per_device_normal(params, s), mesh, axis) for s in (1, 2)]
  compiled = fn.lower(grads[0], states[0]).compile()
  outs = []
  for g in grads:
    out, state = jax.block_until_ready(fn(g, states[-1]))
    outs.append(out)
    states.append(state)
  return dict(tx=tx, fn=fn, mesh=mesh, axis=axis, compiled=compiled, grads=grads,
              states=states, rows=[state_rows(tx, s, params) for s in states], outs=outs)


def state_rows(tx, state, params):
  """``tx``'s per-device ``state`` with each device's on its own row
  (:func:`jaxcomp.training.device_rows`), and the fields held flat per bucket
  (the residual, DGC's momentum) laid out like ``params``
  (:func:`jaxcomp.protocol.as_tree`): ``[devices, *leaf shape]`` leaves."""
  return fused_fields(tx, training.device_rows(state, jax.eval_shape(tx.init, params)),
                      params, protocol.as_tree)


# The state fields held as one flat buffer per bucket: the residual, DGC's momentum.
FUSED_FIELDS = ("residual", "momentum")


def fused_fields(tx, state, params, convert):
  """``state`` with each of :data:`FUSED_FIELDS` it holds converted by ``convert(tx,
  value, params)``: :func:`jaxcomp.protocol.as_tree` or :func:`~jaxcomp.protocol.from_tree`."""
  return state._replace(**{f: convert(tx, getattr(state, f), params)
                           for f in FUSED_FIELDS if jax.tree.leaves(getattr(state, f, ()))})


def two_step_runs(factories, params, meshes):
  """``run(name, mesh_name)``: :func:`run_two_steps` of ``factories[name]``, each case compiled once."""

  @functools.lru_cache(maxsize=None)
  def run(name, mesh_name):
    shape, names = meshes[mesh_name]
    return run_two_steps(factories[name], params, shape, names)

  return run


def flat(tree, device=None):
  """numpy f32 vector of a tree's leaves in ``jax.tree.leaves`` order."""
  leaves = jax.tree.leaves(tree)
  if device is not None:
    leaves = [x[device] for x in leaves]
  return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in leaves])


def one_step_of_normal_gradients(tx, params, seed):
  """One step of ``tx`` on 8 devices of Gaussian gradients shaped like ``params``.

  Returns ``(grads, mean, residuals)``: numpy ``[8, n]`` gradients and
  residuals after the step (each device's row, leaves fused in tree order),
  and device 0's mean ``[n]`` (the mean is checked to be the same on every
  device).
  """
  mesh = training.make_mesh(8)
  state = training.init_state(tx, params, mesh, "data")
  rng = np.random.default_rng(seed)
  grads = jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32), params)
  out, new_state = jax.block_until_ready(training.make_update(tx, mesh, "data")(
      training.shard(grads, mesh, "data"), state))
  assert_same_on_devices(out)
  rows = state_rows(tx, new_state, params)
  stacked = lambda tree: np.stack([flat(tree, device) for device in range(8)])
  return stacked(grads), flat(out, 0), stacked(rows.residual)


def control_flow(compiled_text: str) -> collections.Counter:
  """The ``while`` loops and conditionals of a compiled program, nested ones included."""
  return collections.Counter(
      i.op for body in hlo_counts.computations(compiled_text).values()
      for i in body if i.op in ("while", "conditional"))


def assert_same_on_devices(out):
  """Every leaf's rows (one per device) equal bit for bit."""
  for leaf in jax.tree.leaves(out):
    leaf = np.asarray(leaf)
    for d in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(leaf[d].view(np.uint8), leaf[0].view(np.uint8))


def assert_bitwise_equal(got, want):
  """Two arrays equal bit for bit (NaN payloads and signed zeros included)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ------------------------------------------------------------------ selections


def np_topk(x, k):
  """Indices of the k largest |x| (ties: lower index), the spec of ``lax.top_k``'s choice."""
  return np.argsort(-np.abs(x), kind="stable")[:k]


def random_indices_reference(key, n, k):
  """The spec of random-k's coordinates, sorted int32: one per stratum, rotated.

  ``key`` is the step's draw key. The ``k + 1`` draws are the library's
  (``draws.bits``, as documented in ``sparsify.random_indices``); the
  strata, the modulos, the rotation and the order are numpy's, in int64.
  """
  if k == n:
    return np.arange(n, dtype=np.int32)
  drawn = np.asarray(draws.bits(key, k + 1)).astype(np.int64)
  return rotated_strata_reference(drawn[:k], int(drawn[k] % n), n)


def rotated_strata_reference(drawn, r, n):
  """``k = len(drawn)`` strata of ``[0, n)``, position ``drawn[j] mod size_j`` in each,
  all rotated by ``r`` and sorted, int32 (numpy's int64 arithmetic)."""
  k = len(drawn)
  q, longer = divmod(n, k)
  sizes = np.array([q + 1] * longer + [q] * (k - longer), np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  return np.sort((starts + np.asarray(drawn, np.int64) % sizes + r) % n).astype(np.int32)


def step_draw_keys(seed, steps):
  """``(draw keys of the first steps, the state's key after them)`` from a seed.

  The shared path splits the state's key every step into the next state key
  and the step's draw: ``next, draw = draws.step_keys(key)``.
  """
  key, drawn = jax.random.key(seed), []
  for _ in range(steps):
    key, draw = draws.step_keys(key)
    drawn.append(draw)
  return drawn, key


# ------------------------------------------------------------------ collectives


def prescale(x, num_devices):
  """A payload as it goes on the wire: ``x / P`` in f32, the way XLA:CPU computes it.

  XLA rewrites a division by a constant into a multiplication by its f32
  reciprocal (exact for a power-of-two ``P``, within an ulp of ``x / P``
  otherwise); the oracles do the same.
  """
  return np.asarray(x, np.float32) * (np.float32(1) / np.float32(num_devices))


def reduce_sum_reference(blocks):
  """The spec of ``psum``, the torus all-reduce and ``collectives.reduce_sum``.

  ``blocks``: ``[P, ...]``, one row per device. The exact sum (float64),
  rounded once to f32: equal to any f32 summation order when every partial
  sum is exact (data on a coarse grid, such as integers).
  """
  return np.asarray(blocks, np.float64).sum(axis=0).astype(np.float32)


def sum_rows_reference(rows):
  """The spec of ``collectives.sum_rows``: the f32 sum of ``rows`` (``[P, ...]``) over
  the leading axis, one row after the other in device order."""
  rows = np.asarray(rows, np.float32)
  total = rows[0]
  for row in rows[1:]:
    total = (total + row).astype(np.float32)
  return total


def mean_reference(blocks, wire_dtype=None):
  """The spec of ``collectives.mean``: every device's ``x / P``, summed.

  With a 16-bit ``wire_dtype`` (one axis) each device's ``x / P`` is rounded
  to it before the sum (the all-to-all), the f32 sum is rounded to it again
  (the all-gather) and widened back to f32.
  """
  blocks = np.asarray(blocks, np.float32)
  parts = prescale(blocks, blocks.shape[0])
  if wire_dtype is None:
    return reduce_sum_reference(parts)
  parts = parts.astype(wire_dtype).astype(np.float32)
  return reduce_sum_reference(parts).astype(wire_dtype).astype(np.float32)


def allgather_reference(blocks):
  """The spec of ``collectives.allgather``: every device holds every row, in device order.

  Over a pair of axes the order is the mesh's row-major one (device ``(i, j)``
  of an ``R x C`` mesh is row ``i * C + j``).
  """
  return np.stack([np.asarray(b) for b in blocks])


def sparse_allgather_reference(values, indices):
  """The spec of ``collectives.sparse_allgather``: the all-gather of both halves of the pairs."""
  return allgather_reference(values), allgather_reference(indices).astype(np.int32)


def densify_reference(values, indices, n):
  """The spec of ``collectives.densify``: scatter-add in row order, empty slots and
  indices outside ``[0, n)`` dropped."""
  dense = np.zeros(n, np.float32)
  for v, i in zip(np.asarray(values, np.float32).reshape(-1), np.asarray(indices).reshape(-1)):
    if 0 <= i < n:
      dense[i] = np.float32(dense[i] + v)
  return dense


def merge_topk_reference(va, ia, vb, ib, k):
  """The spec of ``collectives.merge_topk``: sums at equal indices, the k largest |v|.

  Ties go to the lower index; NaN ranks above every number; missing slots hold
  value 0 and index ``EMPTY``.
  """
  sums = {}
  for v, i in zip(np.concatenate([va, vb]), np.concatenate([ia, ib])):
    if i == EMPTY:
      continue
    sums[int(i)] = np.float32(sums[int(i)] + v) if int(i) in sums else np.float32(v)
  magnitude = lambda v: np.inf if np.isnan(v) else abs(v)
  ranked = sorted(sums.items(), key=lambda e: (-magnitude(e[1]), e[0]))[:k]
  ranked += [(EMPTY, np.float32(0))] * (k - len(ranked))
  return (
      np.array([v for _, v in ranked], np.float32),
      np.array([i for i, _ in ranked], np.int32),
  )


def gtopk_allreduce_reference(blocks, k):
  """The spec of ``collectives.gtopk_allreduce`` over per-device ``(values, indices)`` blocks.

  Devices past the largest power of two ``Q`` fold into devices ``i - Q``
  first; round ``r`` merges partners ``i XOR 2**r``; every device ends with
  device 0's pair.
  """
  state = list(blocks)
  size = len(state)
  power = 1 << (size.bit_length() - 1)
  for j in range(size - power):
    state[j] = merge_topk_reference(*state[j], *state[power + j], k)
  distance = 1
  while distance < power:
    state = [merge_topk_reference(*state[i], *state[i ^ distance], k) for i in range(power)]
    distance *= 2
  return state[0]


@functools.lru_cache(maxsize=None)
def gtopk_allreduce_fn(num_devices, k):
  """jit(shard_map) of ``collectives.gtopk_allreduce`` over ``[P, k]`` values and indices."""
  mesh = training.make_mesh(num_devices)

  def per_device(values, indices):
    v, i = collectives.gtopk_allreduce(values[0], indices[0], k, "data")
    return v[None], i[None]

  spec = PartitionSpec("data")
  return jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
      check_vma=False))
