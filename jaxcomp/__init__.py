"""jaxcomp: gradient-compression transforms for data-parallel training.

Every compressor is an ``optax.GradientTransformation`` whose ``update`` runs
inside ``jax.shard_map`` (or ``jax.pmap``) over a bound mesh axis, takes this
device's gradient and returns the decompressed mean, identical on every device.
"""

from jaxcomp import collectives as collectives
from jaxcomp import costmodel as costmodel
from jaxcomp import error_feedback as error_feedback
from jaxcomp import fusion as fusion
from jaxcomp import hierarchy as hierarchy
from jaxcomp import nnx as nnx
from jaxcomp import protocol as protocol
from jaxcomp import registry as registry
from jaxcomp import selection as selection
from jaxcomp import training as training
from jaxcomp import wire as wire
from jaxcomp.deep_gradient_compression import DGCState as DGCState
from jaxcomp.deep_gradient_compression import dgc as dgc
from jaxcomp.dense import allreduce as allreduce
from jaxcomp.dense import cast as cast
from jaxcomp.hierarchy import HierarchicalState as HierarchicalState
from jaxcomp.hierarchy import hierarchical as hierarchical
from jaxcomp.lowrank import ACPSGDState as ACPSGDState
from jaxcomp.lowrank import PowerSGDState as PowerSGDState
from jaxcomp.lowrank import acpsgd as acpsgd
from jaxcomp.lowrank import powersgd as powersgd
from jaxcomp.stochastic_quantization import QSGDState as QSGDState
from jaxcomp.stochastic_quantization import qsgd as qsgd
from jaxcomp.quantize import SignSGDState as SignSGDState
from jaxcomp.quantize import signsgd as signsgd
from jaxcomp.registry import check_chain as check_chain
from jaxcomp.sparsify import GTopKState as GTopKState
from jaxcomp.sparsify import RandomKState as RandomKState
from jaxcomp.sparsify import TopKState as TopKState
from jaxcomp.sparsify import gtopk as gtopk
from jaxcomp.sparsify import randomk as randomk
from jaxcomp.sparsify import topk as topk

__version__ = "0.1.0"

__all__ = (
    "ACPSGDState",
    "DGCState",
    "GTopKState",
    "HierarchicalState",
    "PowerSGDState",
    "QSGDState",
    "RandomKState",
    "SignSGDState",
    "TopKState",
    "acpsgd",
    "allreduce",
    "cast",
    "check_chain",
    "collectives",
    "costmodel",
    "dgc",
    "error_feedback",
    "fusion",
    "gtopk",
    "hierarchical",
    "hierarchy",
    "nnx",
    "powersgd",
    "protocol",
    "qsgd",
    "randomk",
    "registry",
    "selection",
    "signsgd",
    "topk",
    "training",
    "wire",
)
