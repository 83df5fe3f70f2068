"""What is exchanged: the gradient shapes and the methods, shared by launcher and workers.

One level: the jaxcomp methods are :data:`jaxcomp.registry.METHODS` with
their defaults (built with :func:`jaxcomp.registry.build`) over one axis;
the torch rows run PyTorch DDP with one of its comm hooks, and are priced by
the cost model as their jaxcomp twin.

Two levels: the mesh is ``(nodes, L)`` with the axes :data:`MESH_AXES`
(slow, then fast), processes ``n L`` to ``n L + L - 1`` on node ``n``, and
the rows are :data:`TWO_LEVEL_ROWS`: the dense mean as one flat ring and as
the 2D torus, flat gTop-k over both axes, and :func:`jaxcomp.hierarchical`
around a compressor over the slow axis (gTop-k also with bfloat16 on the
links inside a node).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import shapes
import jaxcomp
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import wire

MODELS = {"resnet50": shapes.resnet50, "transformer": shapes.transformer}

# torch row -> the jaxcomp method that sends the same bytes (for the prediction).
TORCH_TWINS = {
    "torch_allreduce": "allreduce",
    "torch_fp16": "cast",
    "torch_powersgd": "powersgd",
}

# The two-level mesh's axes: between nodes (slow), inside a node (fast).
MESH_AXES = ("node", "local")
SLOW, FAST = MESH_AXES

# Two-level row -> what it runs, in words (see :func:`build`).
TWO_LEVEL_ROWS = {
    "allreduce_ring": "dense mean, one ring over all processes (psum over both axes)",
    "allreduce_torus": "dense mean, 2D torus: reduce-scatter and all-gather inside"
                       " a node, all-reduce of the 1/L chunk between nodes",
    "gtopk": "gTop-k butterfly over both axes",
    "hierarchical_gtopk": "hierarchical(gtopk over node)",
    "hierarchical_gtopk_bf16": "hierarchical(gtopk over node), bfloat16 on the links inside"
                               " a node (fast_dtype)",
    "hierarchical_dgc": "hierarchical(dgc over node)",
    "hierarchical_powersgd": "hierarchical(powersgd over node)",
    "hierarchical_acpsgd": "hierarchical(acpsgd over node)",
}
_HIERARCHICAL = "hierarchical_"
_BF16 = "_bf16"

# Pipelined rows (``--pipelined``): a whole training step, the gradient made by a
# backward pass, exchanged in one bucket or in torch DDP's 25 MiB buckets.
PIPELINED_METHODS = ("allreduce", "gtopk", "powersgd", "acpsgd")
_BUCKETS = "_buckets"
PIPELINED_CAP_MB = 25.0
PIPELINED_ROWS = tuple(m + suffix for m in PIPELINED_METHODS for suffix in ("", _BUCKETS))
# Samples per worker of the pipelined step's batch.
PIPELINED_BATCH = 8

_SYNTHETIC_WIDTH = 128


def method_names() -> list[str]:
  return [*registry.names(), *TORCH_TWINS]


def is_torch(method: str) -> bool:
  return method in TORCH_TWINS


def jax_method(method: str) -> str:
  """The jaxcomp method a row is built (or priced) as (for two levels: the one inside)."""
  if method.startswith(_HIERARCHICAL):
    return method[len(_HIERARCHICAL):].removesuffix(_BF16)
  if method.endswith(_BUCKETS):
    return method[:-len(_BUCKETS)]
  if method.startswith("allreduce_"):
    return "allreduce"
  return TORCH_TWINS.get(method, method)


def config(method: str) -> dict:
  """The configuration a row runs with (the registry's defaults; a pipelined row's
  ``_buckets`` twin with :data:`PIPELINED_CAP_MB` MiB buckets)."""
  buckets = {"bucket_cap_mb": PIPELINED_CAP_MB} if method.endswith(_BUCKETS) else {}
  return {**registry.configuration(jax_method(method)), **buckets}


def build(method: str, mesh_shape: Optional[Mapping[str, int]] = None
          ) -> optax.GradientTransformation:
  """The compressor of a row: over the axis ``"data"``, or over ``mesh_shape``'s two axes.

  Two levels: ``allreduce_torus`` reduce-scatters over the fast axis first,
  so that the slow links carry only the all-reduce of the ``1/L`` chunk.
  """
  if mesh_shape is None:
    return registry.build(jax_method(method), "data", **config(method))
  if method not in TWO_LEVEL_ROWS:
    raise ValueError(f"`method` must be one of {list(TWO_LEVEL_ROWS)}, got {method!r}")
  if method == "allreduce_ring":
    return flat_ring_allreduce(MESH_AXES)
  if method == "allreduce_torus":
    return registry.build("allreduce", (FAST, SLOW))
  if method == "gtopk":
    return registry.build("gtopk", MESH_AXES, **config(method))
  inner = registry.build(jax_method(method), SLOW, **config(method))
  fast_dtype = jnp.bfloat16 if method.endswith(_BF16) else None
  return jaxcomp.hierarchical(inner, FAST, mesh_shape[FAST], fast_dtype=fast_dtype)


def flat_ring_allreduce(axes: Sequence[str]) -> optax.GradientTransformation:
  """The dense mean as one ``psum`` over all of ``axes``: a flat ring, blind to the levels.

  ``jaxcomp.allreduce`` over a pair of axes runs the 2D torus; this is the
  baseline it is compared with. Wire: ``2 (P - 1) / P * 4 n`` bytes per
  device over all the axes (in a ring over ``P`` devices in mesh order,
  ``nodes`` of the ``P`` hops cross between nodes).
  """
  axes = tuple(axes)

  def step(ctx, corrected, state):
    del state
    return protocol.Output(mean=lax.psum(ctx.send(corrected), ctx.axes))

  def wire_cost(bucket, sizes, steps):
    del steps
    return wire.allreduce(bucket.size * 4, sizes) if bucket.size else ()

  return protocol.compressor(protocol.Method(
      name="allreduce", config={"axis_name": axes, "flat_ring": True}, axes=axes,
      state=optax.EmptyState, step=step, wire=wire_cost, propagates_nonfinite=True))


def chain_loss(params, batch) -> jax.Array:
  """A loss whose backward pass makes every gradient in turn, last leaf first.

  The leaves are layers of a chain, in tree order: leaf ``l`` viewed as a
  matrix ``W_l`` (``[rest, last]``; a vector as one row) multiplies its own
  input ``x_l`` (``batch``'s leaf, ``[B, rows of W_l]``) scaled by what the
  layer before produced, ``h_l = tanh(s_l x_l W_l)``, ``s_{l+1} = 1 +
  mean(h_l)``; the loss is the last ``s``. So the gradient of ``W_l`` needs
  the backward pass through every later layer, as in a network, and the
  work is ``2 B n`` multiply-adds forward, twice that backward.
  """
  scale = jnp.ones([], jnp.float32)
  for leaf, x in zip(jax.tree.leaves(params), jax.tree.leaves(batch)):
    matrix = leaf.reshape(-1, leaf.shape[-1]) if leaf.ndim >= 2 else leaf.reshape(1, -1)
    scale = 1.0 + jnp.mean(jnp.tanh(scale * (x @ matrix)))
  return scale


def chain_batch(shapes, key: jax.Array, batch: int = PIPELINED_BATCH):
  """One worker's inputs of :func:`chain_loss`: ``[batch, rows]`` per leaf of ``shapes``."""
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))
  rows = [math.prod(s.shape[:-1]) if len(s.shape) >= 2 else 1 for s in leaves]
  return jax.tree.unflatten(treedef, [
      jax.random.normal(k, (batch, r), jnp.float32) for k, r in zip(keys, rows)])


def mesh_devices(devices: Sequence, mesh_shape: Mapping[str, int]) -> np.ndarray:
  """``devices`` as the mesh array: in process order, process ``n L + j`` at ``[n, j]``."""
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  return np.array(ordered, dtype=object).reshape(tuple(mesh_shape.values()))


def gradient_shapes(model: str, size: Optional[int] = None) -> dict:
  """ResNet-50's (or another model's) gradient shapes; ``size`` floats of a small stand-in.

  The stand-in is a dense layer ``(rows, 128)`` and its bias, ``rows`` chosen
  so that there are about ``size`` floats: enough for every method (the
  kernel is a matrix the low-rank methods compress).
  """
  if size is not None:
    rows = max(2, math.ceil((size - _SYNTHETIC_WIDTH) / _SYNTHETIC_WIDTH))
    return {"dense": {
        "kernel": jax.ShapeDtypeStruct((rows, _SYNTHETIC_WIDTH), jnp.float32),
        "bias": jax.ShapeDtypeStruct((_SYNTHETIC_WIDTH,), jnp.float32),
    }}
  return MODELS[model]()


def torch_layout(shape: tuple[int, ...]) -> tuple[int, ...]:
  """A Flax shape in PyTorch's layout: HWIO kernels as OIHW, (in, out) as (out, in).

  PowerSGD views a torch tensor as ``(shape[0], rest)`` and a jaxcomp one as
  ``(rest, shape[-1])``: in these layouts both compress the same matrices.
  """
  if len(shape) == 4:
    h, w, i, o = shape
    return (o, i, h, w)
  if len(shape) == 2:
    return (shape[1], shape[0])
  return tuple(shape)


# ------------------------------------------------- launcher <-> worker phases
#
# A worker compiles once and then measures one phase per bandwidth: it waits
# for the launcher's file ``phase<i>`` (written once the links are shaped),
# times its steps and writes ``result<host>_<i>.json``. The last file, its
# compute times and everything measured once, is ``spec["out"]``.

_POLL_S = 0.05


def phase_path(sync_dir: str, phase: int) -> str:
  return os.path.join(sync_dir, f"phase{phase}")


def phase_result_path(sync_dir: str, host: int, phase: int) -> str:
  return os.path.join(sync_dir, f"result{host}_{phase}.json")


def wait_for_phase(sync_dir: str, phase: int, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(phase_path(sync_dir, phase)):
    if time.monotonic() > deadline:
      raise TimeoutError(f"no go for phase {phase} after {timeout_s:g} s")
    time.sleep(_POLL_S)


def write_json(path: str, value) -> None:
  """Writes ``path`` whole or not at all (a reader never sees half a file)."""
  with open(path + ".tmp", "w") as f:
    json.dump(value, f)
  os.replace(path + ".tmp", path)


def net_dev_tx_bytes(text: str, interfaces: Sequence[str]) -> int:
  """The summed ``tx_bytes`` of ``interfaces`` in a ``/proc/<pid>/net/dev`` listing.

  Raises:
    KeyError: an interface is not listed.
  """
  sent = {}
  for line in text.splitlines():
    if ":" in line:
      name, fields = line.split(":", 1)
      sent[name.strip()] = int(fields.split()[8])
  return sum(sent[name] for name in interfaces)


def uplink_tx_bytes(pid: int, interfaces: Sequence[str]) -> Optional[int]:
  """Bytes ``interfaces`` of process ``pid``'s network namespace have sent (``None``: none).

  A worker lives in its own namespace; the launcher's (``pid``) holds the
  uplinks between nodes, and ``/proc/<pid>/net/dev`` lists that namespace's
  interfaces from anywhere.
  """
  if not interfaces:
    return None
  with open(f"/proc/{pid}/net/dev") as f:
    return net_dev_tx_bytes(f.read(), interfaces)


def tx_bytes(interface: Optional[str]) -> Optional[int]:
  """Bytes ``interface`` has sent so far (``None`` without an interface to read)."""
  if interface is None:
    return None
  with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
    return int(f.read())
