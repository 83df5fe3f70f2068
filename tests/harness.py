"""Helpers that several test modules share (8 fake CPU devices, see conftest.py)."""

import chex
import jax
import numpy as np

from jaxcomp import training


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


def step_fn(tx, mesh, axis, max_traces=None):
  """jit(shard_map(update)) over stacked per-device gradients and state."""
  wrap = None if max_traces is None else (lambda f: chex.assert_max_traces(f, n=max_traces))
  return training.make_update(tx, mesh, axis, wrap=wrap)


def run_two_steps(make_tx, params, mesh_shape, axis_names):
  """Two steps of ``make_tx(axis)`` on a mesh; everything the tests read, compiled once."""
  axis = axis_of(axis_names)
  mesh = training.make_mesh(mesh_shape, axis_names)
  tx = make_tx(axis)
  fn = step_fn(tx, mesh, axis)
  states = [training.stack_per_device(tx.init(params), mesh, axis)]
  grads = [training.shard(per_device_normal(params, s), mesh, axis) for s in (1, 2)]
  compiled = fn.lower(grads[0], states[0]).compile()
  outs = []
  for g in grads:
    out, state = fn(g, states[-1])
    outs.append(out)
    states.append(state)
  return dict(tx=tx, fn=fn, mesh=mesh, axis=axis, compiled=compiled,
              grads=grads, states=states, outs=outs)


def flat(tree, device=None):
  """numpy f32 vector of a tree's leaves in ``jax.tree.leaves`` order."""
  leaves = jax.tree.leaves(tree)
  if device is not None:
    leaves = [x[device] for x in leaves]
  return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in leaves])


def assert_same_on_devices(out):
  """Every leaf's rows (one per device) equal bit for bit."""
  for leaf in jax.tree.leaves(out):
    leaf = np.asarray(leaf)
    for d in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(leaf[d].view(np.uint8), leaf[0].view(np.uint8))


def np_topk(x, k):
  """Indices of the k largest |x| (ties: lower index), the spec of select_topk."""
  return np.argsort(-np.abs(x), kind="stable")[:k]
