"""jaxcomp: gradient-compression transforms for data-parallel training.

Every compressor is an ``optax.GradientTransformation`` whose ``update`` runs
inside ``jax.shard_map`` (or ``jax.pmap``) over a bound mesh axis, takes this
device's gradient and returns the decompressed mean, identical on every device.

The top level holds the compressors, their states and :func:`hierarchical`;
the public modules: :mod:`jaxcomp.training` (layout, steps, FSDP,
checkpoints), :mod:`jaxcomp.nnx` (Flax NNX; needs the ``flax`` extra),
:mod:`jaxcomp.wire` (bytes), :mod:`jaxcomp.costmodel`,
:mod:`jaxcomp.collectives`, and for method authors :mod:`jaxcomp.protocol`,
:mod:`jaxcomp.registry` and :mod:`jaxcomp.selection`.
"""

import importlib

from jaxcomp import collectives as collectives
from jaxcomp import costmodel as costmodel
from jaxcomp import protocol as protocol
from jaxcomp import registry as registry
from jaxcomp import selection as selection
from jaxcomp import training as training
from jaxcomp import wire as wire
from jaxcomp._src.dense import allreduce as allreduce
from jaxcomp._src.dense import cast as cast
from jaxcomp._src.demo import DeMoState as DeMoState
from jaxcomp._src.demo import demo as demo
from jaxcomp._src.dgc import DGCState as DGCState
from jaxcomp._src.dgc import dgc as dgc
from jaxcomp._src.hierarchical import HierarchicalState as HierarchicalState
from jaxcomp._src.hierarchical import hierarchical as hierarchical
from jaxcomp._src.lowrank import ACPSGDState as ACPSGDState
from jaxcomp._src.lowrank import PowerSGDState as PowerSGDState
from jaxcomp._src.lowrank import acpsgd as acpsgd
from jaxcomp._src.lowrank import powersgd as powersgd
from jaxcomp._src.qsgd import QSGDState as QSGDState
from jaxcomp._src.qsgd import qsgd as qsgd
from jaxcomp._src.quantized import QuantizedState as QuantizedState
from jaxcomp._src.quantized import quantized as quantized
from jaxcomp._src.registry import check_chain as check_chain
from jaxcomp._src.signsgd import SignSGDState as SignSGDState
from jaxcomp._src.sparseloco import SparseLoCoState as SparseLoCoState
from jaxcomp._src.sparseloco import sparseloco as sparseloco
from jaxcomp._src.signsgd import signsgd as signsgd
from jaxcomp._src.sparsify import GTopKState as GTopKState
from jaxcomp._src.sparsify import RandomKState as RandomKState
from jaxcomp._src.sparsify import TopKState as TopKState
from jaxcomp._src.sparsify import gtopk as gtopk
from jaxcomp._src.sparsify import randomk as randomk
from jaxcomp._src.sparsify import topk as topk

__version__ = "0.1.0"


def __getattr__(name: str):
  # `jaxcomp.nnx` imports Flax, an optional dependency: loaded on first use, so
  # that `import jaxcomp` works without it.
  if name == "nnx":
    return importlib.import_module("jaxcomp.nnx")
  raise AttributeError(f"module 'jaxcomp' has no attribute {name!r}")


__all__ = (
    "ACPSGDState",
    "DeMoState",
    "DGCState",
    "GTopKState",
    "HierarchicalState",
    "PowerSGDState",
    "QSGDState",
    "QuantizedState",
    "RandomKState",
    "SignSGDState",
    "SparseLoCoState",
    "TopKState",
    "acpsgd",
    "allreduce",
    "cast",
    "check_chain",
    "collectives",
    "costmodel",
    "demo",
    "dgc",
    "gtopk",
    "hierarchical",
    "nnx",
    "powersgd",
    "protocol",
    "qsgd",
    "quantized",
    "randomk",
    "registry",
    "selection",
    "signsgd",
    "sparseloco",
    "topk",
    "training",
    "wire",
)
