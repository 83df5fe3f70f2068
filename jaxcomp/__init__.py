"""jaxcomp: gradient-compression transforms for data-parallel training.

Every compressor is an ``optax.GradientTransformation`` whose ``update`` runs
inside ``jax.shard_map`` (or ``jax.pmap``) over a bound mesh axis, takes this
device's gradient and returns the decompressed mean, identical on every device.
"""

from jaxcomp import collectives as collectives
from jaxcomp import error_feedback as error_feedback
from jaxcomp import fusion as fusion
from jaxcomp import training as training
from jaxcomp import wire as wire
from jaxcomp.base import Compressor as Compressor
from jaxcomp.dense import allreduce as allreduce
from jaxcomp.dense import cast as cast

__version__ = "0.1.0"

__all__ = (
    "Compressor",
    "allreduce",
    "cast",
    "collectives",
    "error_feedback",
    "fusion",
    "training",
    "wire",
)
