"""One JAX worker of a netbench run: one CPU device, gloo collectives.

``python -m experiments.netbench.worker SPEC.json`` joins the other workers
with ``jax.distributed.initialize``, draws this worker's gradient (a Gaussian
pytree, its key folded with the process index), and times the compressor's
``update`` under ``jax.jit(jax.shard_map(...))`` over a mesh of every
process's device, as a user's step runs it. Before each timed step a tiny
``psum`` lines the workers up, so every worker times the same step; the
interface counters are read between line-ups too, once every step's bytes
have crossed the links.

It compiles once and measures one phase per bandwidth (see
:func:`workload.wait_for_phase`): step times and the bytes its network
interface sent during the timed steps. Then it times the same ``update`` on a
mesh of its own device alone (the collectives over a group of one vanish), all
workers at once so that they contend for the cores as in the real step: the
compression compute. ``SPEC["out"]`` gets the compute times, the bytes of the
compiled step (:func:`jaxcomp.wire.collective_bytes`) and a digest of the
result (equal on every worker when the output is bitwise identical).

Pipelined (``SPEC["pipelined"]``): beside the update alone, each phase also
times a whole training step (:func:`jaxcomp.training.make_step` of
:func:`workload.chain_loss`, the compressor chained with SGD): forward,
backward, exchange and update, where a bucket's exchange may start while the
backward pass makes the earlier layers' gradients; its compute is timed
alone as the update's is.

Two levels (``SPEC["mesh_shape"]``, see :mod:`.workload`): the mesh is
``(nodes, L)`` over every process's device; there is no compute on one
device alone (:func:`jaxcomp.hierarchical` needs its fast axis), the
launcher times an unshaped phase instead; the compiled step's bytes are
also given per mesh axis, and process 0 reads the uplinks between nodes
(``SPEC["uplinks"]``, in the launcher's namespace) with its own counters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 1)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from experiments import shapes as shapes_lib  # noqa: E402
from experiments.netbench import workload  # noqa: E402
from jaxcomp import training  # noqa: E402
from jaxcomp import wire  # noqa: E402

AXIS = "data"


def _stacked(tree, mesh):
  """This process's arrays as the local row of ``[P, ...]`` arrays sharded over ``mesh``."""
  return _global(jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree), mesh)


def _per_device(state, mesh):
  """This process's state as its block of the per-device layout (``training.init_state``'s)."""
  return _global(training.local_to_blocks(state), mesh)


def _global(blocks, mesh):
  """Global arrays sharded over ``mesh`` on their first dimension, this process's block given."""
  count = mesh.devices.size
  return _assembled(blocks, NamedSharding(mesh, PartitionSpec(mesh.axis_names)),
                    lambda x: (count * x.shape[0],) + x.shape[1:])


def _replicated(tree, mesh):
  """Global arrays replicated over ``mesh``, each process giving its own (equal) copy."""
  return _assembled(tree, NamedSharding(mesh, PartitionSpec()), lambda x: x.shape)


def _assembled(tree, sharding, global_shape):
  """Global arrays of ``sharding``, this process's one device holding ``tree``'s arrays."""
  device = jax.local_devices()[0]
  return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
      global_shape(x), sharding, [jax.device_put(x, device)]), tree)


# Untimed steps that compile every form of a pipelined row's step (ACP-SGD
# alternates two programs; the other rows have one).
_FORMS = 2


class Training:
  """The pipelined row's whole training step on ``mesh``: its program and its inputs."""

  def __init__(self, tx, shapes, seed: int, host: int, mesh, axes):
    self.tx = optax.chain(tx, optax.sgd(1e-3))
    self.params = shapes_lib.normal(shapes, jax.random.key(seed + 1))  # the same everywhere
    self.batch = workload.chain_batch(shapes, jax.random.fold_in(jax.random.key(seed + 2), host))
    self.mesh, self.axes = mesh, axes
    self.step = training.make_step(workload.chain_loss, self.tx, mesh, axes)

  def inputs(self):
    """Fresh ``(params, opt_state, batch)``: the step donates its parameters and state."""
    return (_replicated(self.params, self.mesh),
            _per_device(self.tx.init(self.params), self.mesh),
            _global(self.batch, self.mesh))

  def timed(self, barrier, count, inputs):
    """``count`` steps, each after a line-up: their seconds and the inputs to go on with."""
    params, state, batch = inputs

    def step(carried):
      params, state, metrics = self.step(*carried, batch)
      return metrics, (params, state)

    times, _, (params, state) = _timed(step, (params, state), barrier, count)
    return times, (params, state, batch)


def _timed(step, state, barrier, count):
  """``count`` steps ``step(state) -> (out, state)``, each after a line-up: their
  seconds, the last output, the state."""
  times, out = [], None
  for _ in range(count):
    barrier()
    start = time.perf_counter()
    out, state = step(state)
    jax.block_until_ready((out, state))
    times.append(time.perf_counter() - start)
  return times, out, state


def _update(step, grads):
  """``step(grads, state)`` as a step of the state alone (:func:`_timed`)."""
  return lambda state: step(grads, state)


def run(spec: dict) -> dict:
  jax.distributed.initialize(
      coordinator_address=spec["coordinator"],
      num_processes=spec["num_processes"],
      process_id=spec["process_id"],
      initialization_timeout=spec["init_timeout_s"],
  )
  host = jax.process_index()
  mesh_shape = spec["mesh_shape"] or {AXIS: spec["num_processes"]}
  axes = tuple(mesh_shape)
  mesh = Mesh(workload.mesh_devices(jax.devices(), mesh_shape), axes)
  ones = _stacked(jnp.ones([], jnp.float32), mesh)
  line_up = jax.jit(jax.shard_map(
      lambda x: jax.lax.psum(x, axes), mesh=mesh, in_specs=PartitionSpec(axes),
      out_specs=PartitionSpec(axes), check_vma=False))
  barrier = lambda: jax.block_until_ready(line_up(ones))
  # The first collective sets up gloo's connections, and gives up when a
  # worker is more than 30 s late: do it while the workers are in step.
  barrier()

  shapes = workload.gradient_shapes(spec["model"], spec["size"])
  key = jax.random.fold_in(jax.random.key(spec["seed"]), host)
  grads = shapes_lib.normal(shapes, key)
  tx = workload.build(spec["method"], spec["mesh_shape"])

  global_grads = _stacked(grads, mesh)
  state = _per_device(tx.init(grads), mesh)
  start = time.perf_counter()
  step = training.make_update(tx, mesh, axes, donate=True).lower(global_grads, state).compile()
  compile_s = time.perf_counter() - start
  counted = wire.collective_bytes(step, mesh_shape=mesh_shape)
  uplinks = lambda: workload.uplink_tx_bytes(spec["launcher_pid"], spec["uplinks"])
  train = Training(tx, shapes, spec["seed"], host, mesh, AXIS) if spec["pipelined"] else None
  train_inputs = train.inputs() if train else None

  for phase in range(spec["phases"]):
    workload.wait_for_phase(spec["sync_dir"], phase, spec["phase_timeout_s"])
    _, _, state = _timed(_update(step, global_grads), state, barrier, spec["warmup"])
    # A worker leaves a step once it has received what it needs, while what it
    # sent may still wait in its socket buffer and qdisc. Past a line-up every
    # worker has finished the steps before, so every byte they sent has
    # crossed its eth0 (and the uplinks): the counters are read there.
    barrier()
    sent_before, up_before = workload.tx_bytes(spec["interface"]), uplinks()
    times, out, state = _timed(_update(step, global_grads), state, barrier, spec["steps"])
    barrier()
    sent_after, up_after = workload.tx_bytes(spec["interface"]), uplinks()
    results = {
        "step_times_s": times,
        "tx_bytes": None if sent_before is None else sent_after - sent_before,
        "uplink_tx_bytes": None if up_before is None else up_after - up_before,
    }
    if train:
      _, train_inputs = train.timed(barrier, spec["warmup"] + _FORMS, train_inputs)
      results["train_step_times_s"], train_inputs = train.timed(
          barrier, spec["steps"], train_inputs)
    workload.write_json(workload.phase_result_path(spec["sync_dir"], host, phase), results)
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(out):
    digest.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
  del out, state, global_grads, train_inputs

  result = {
      "process": host,
      "pid": os.getpid(),
      "compile_s": compile_s,
      "collective_bytes": str(counted.total),
      "collective_bytes_by_kind": {k: str(v) for k, v in counted.by_kind.items()},
      "collective_bytes_by_axes": {"+".join(k): str(v) for k, v in counted.by_axes.items()},
      "output_sha256": digest.hexdigest(),
  }
  if spec["mesh_shape"] is None:
    result["compute_times_s"] = _compute_alone(tx, grads, barrier, spec["compute_steps"])
  if train:
    alone = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    local = Training(tx, shapes, spec["seed"], host, alone, AXIS)
    _, inputs = local.timed(barrier, _FORMS, local.inputs())
    result["train_compute_times_s"], _ = local.timed(barrier, spec["compute_steps"], inputs)
    barrier()
  return result


def _compute_alone(tx, grads, barrier, count: int) -> list[float]:
  """Seconds of ``count`` steps of the update on a mesh of this device alone (no network)."""
  alone = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
  local_grads = _stacked(grads, alone)
  local_state = _per_device(tx.init(grads), alone)
  local_step = training.make_update(tx, alone, AXIS, donate=True).lower(
      local_grads, local_state).compile()
  local = _update(local_step, local_grads)
  _, _, local_state = _timed(local, local_state, barrier, 1)
  compute, _, _ = _timed(local, local_state, barrier, count)
  barrier()
  return compute


def main(argv) -> int:
  with open(argv[1]) as f:
    spec = json.load(f)
  try:
    result = run(spec)
    status = 0
  except Exception:  # the launcher records it in the JSON
    result = {"error": traceback.format_exc()}
    status = 1
  workload.write_json(spec["out"], result)
  if status == 0:
    jax.distributed.shutdown()
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv))
