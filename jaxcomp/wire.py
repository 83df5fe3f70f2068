"""Bytes on the wire: every compressor's formula, and what a compiled program sends.

:func:`expected_bytes` gives the formula's bytes for the compressors inside
any transformation; :func:`collective_bytes` reads the bytes one device sends
from a compiled program, with the same ring formulas.
"""

from jaxcomp._src.wire import Kind as Kind
from jaxcomp._src.wire import ring_bytes as ring_bytes
from jaxcomp._src.wire import Transfer as Transfer
from jaxcomp._src.wire import WireCost as WireCost
from jaxcomp._src.wire import Group as Group
from jaxcomp._src.wire import transfer as transfer
from jaxcomp._src.wire import in_branch as in_branch
from jaxcomp._src.wire import allreduce as allreduce
from jaxcomp._src.wire import mean as mean
from jaxcomp._src.wire import torus_allreduce as torus_allreduce
from jaxcomp._src.wire import allgather as allgather
from jaxcomp._src.wire import all_to_all as all_to_all
from jaxcomp._src.wire import sparse_allgather as sparse_allgather
from jaxcomp._src.wire import gtopk as gtopk
from jaxcomp._src.wire import CollectiveOp as CollectiveOp
from jaxcomp._src.wire import WireBytes as WireBytes
from jaxcomp._src.wire import collective_bytes as collective_bytes
from jaxcomp._src.wire import expected_bytes as expected_bytes
from jaxcomp._src.wire import tally as tally
from jaxcomp._src.wire import transfers as transfers

__all__ = (
    "all_to_all",
    "allgather",
    "allreduce",
    "collective_bytes",
    "CollectiveOp",
    "expected_bytes",
    "Group",
    "gtopk",
    "in_branch",
    "Kind",
    "mean",
    "ring_bytes",
    "sparse_allgather",
    "tally",
    "torus_allreduce",
    "Transfer",
    "transfer",
    "transfers",
    "WireBytes",
    "WireCost",
)
