"""The golden file: every method's outputs and states over 20 steps, bit for bit.

Recorded before the compressors moved onto one shared path, and checked by
``tests/test_golden.py`` ever since: a change that alters one bit of any
method's mean gradient or state, on a ring of 8 or a 2x4 torus, fails it.
Gradients come from numpy's generator (stable across JAX versions); each
step is blocked on before the next (no queued collectives on fake devices).

  python tests/golden.py     # rewrite tests/golden.json (a deliberate change only)
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

STEPS = 20
PATH = pathlib.Path(__file__).with_name("golden.json")
MESHES = {"ring": (8, ("data",)), "torus": ((2, 4), ("x", "y"))}

# A conv kernel and two equal dense kernels (low rank pays, one batch), a
# bias, and a small matrix (sent dense by the low-rank methods and by DGC's
# default rule).
SHAPES = {
    "conv": (3, 3, 4, 8),
    "dense": {"kernel": (16, 12), "bias": (12,)},
    "dense2": (16, 12),
    "small": (2, 3),
}


def cases():
  """name -> compressor for an axis (configurations the golden file records)."""
  import jaxcomp  # after the device count is set by the caller

  return {
      "allreduce": lambda axis: jaxcomp.allreduce(axis),
      "cast": lambda axis: jaxcomp.cast(jnp.bfloat16, axis),
      "topk": lambda axis: jaxcomp.topk(0.2, axis),
      "topk_no_error_feedback": lambda axis: jaxcomp.topk(0.2, axis, error_feedback=False),
      "gtopk": lambda axis: jaxcomp.gtopk(0.2, axis),
      "randomk": lambda axis: jaxcomp.randomk(0.2, axis, seed=3),
      # The clipping threshold is set above every device's gradient norm: the clip
      # runs and scales by exactly 1. An active clip's scale comes from an f32
      # reduction whose summation order XLA picks per host CPU, so its bits differ
      # between machines (its values are checked against numpy in
      # test_deep_gradient_compression.py).
      "dgc": lambda axis: jaxcomp.dgc(0.1, axis, clip_norm=1e3, sample_ratio=0.5),
      "dgc_nesterov_all": lambda axis: jaxcomp.dgc(
          0.05, axis, momentum=0.8, nesterov=True, sparse_leaves="all", sample_ratio=1.0),
      "signsgd": lambda axis: jaxcomp.signsgd(axis),
      "signsgd_majority": lambda axis: jaxcomp.signsgd(axis, majority_vote=True),
      "powersgd": lambda axis: jaxcomp.powersgd(2, axis),
      "powersgd_cold": lambda axis: jaxcomp.powersgd(2, axis, warm_start=False),
      "acpsgd": lambda axis: jaxcomp.acpsgd(2, axis),
  }


def _gradients(step: int, devices: int):
  rng = np.random.default_rng(1000 + step)
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  return jax.tree.unflatten(
      treedef, [rng.normal(size=(devices,) + s).astype(np.float32) for s in leaves])


def _digest(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    h.update(str((leaf.dtype, leaf.shape)).encode())
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()[:24]


def run(name: str, mesh_name: str) -> list[list[str]]:
  """``[output digest, state digest]`` of every step of one case."""
  from jaxcomp import training

  shape, names = MESHES[mesh_name]
  axis = names[0] if len(names) == 1 else names
  mesh = training.make_mesh(shape, names)
  tx = cases()[name](axis)
  params = jax.tree.map(
      lambda s: jnp.zeros(s, jnp.float32), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  state = training.init_state(tx, params, mesh, axis)
  update = training.make_update(tx, mesh, axis)
  like = jax.eval_shape(tx.init, params)
  devices = training.num_replicas(mesh, axis)
  digests = []
  for step in range(STEPS):
    grads = training.shard(_gradients(step, devices), mesh, axis)
    out, state = jax.block_until_ready(update(grads, state))
    # Each device's state on its own row: the layout the digests were recorded in.
    digests.append([_digest(out), _digest(training.device_rows(state, like))])
  return digests


def record() -> dict:
  return {f"{name}/{mesh}": run(name, mesh) for name in cases() for mesh in MESHES}


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  PATH.write_text(json.dumps(record(), indent=1) + "\n")
  print(f"wrote {PATH}")
