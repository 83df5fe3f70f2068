"""What is exchanged: the gradient shapes and the methods, shared by launcher and workers.

The jaxcomp methods are :data:`jaxcomp.registry.METHODS` with their defaults
(built with :func:`jaxcomp.registry.build`); the torch rows run PyTorch DDP
with one of its comm hooks, and are priced by the cost model as their
jaxcomp twin.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp

from experiments import shapes
from jaxcomp import registry

MODELS = {"resnet50": shapes.resnet50, "transformer": shapes.transformer}

# torch row -> the jaxcomp method that sends the same bytes (for the prediction).
TORCH_TWINS = {
    "torch_allreduce": "allreduce",
    "torch_fp16": "cast",
    "torch_powersgd": "powersgd",
}

_SYNTHETIC_WIDTH = 128


def method_names() -> list[str]:
  return [*registry.names(), *TORCH_TWINS]


def is_torch(method: str) -> bool:
  return method in TORCH_TWINS


def jax_method(method: str) -> str:
  """The jaxcomp method a row is built (or priced) as."""
  return TORCH_TWINS.get(method, method)


def config(method: str) -> dict:
  """The configuration a row runs with (the registry's defaults)."""
  return registry.configuration(jax_method(method))


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


def tx_bytes(interface: Optional[str]) -> Optional[int]:
  """Bytes ``interface`` has sent so far (``None`` without an interface to read)."""
  if interface is None:
    return None
  with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
    return int(f.read())
