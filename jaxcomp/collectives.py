"""The collectives the compressors are built from, usable on their own inside ``shard_map``."""

from jaxcomp._src.collectives import EMPTY_INDEX as EMPTY_INDEX
from jaxcomp._src.collectives import order_token as order_token
from jaxcomp._src.collectives import reduce_sum as reduce_sum
from jaxcomp._src.collectives import reduce_scatter as reduce_scatter
from jaxcomp._src.collectives import allgather_chunks as allgather_chunks
from jaxcomp._src.collectives import mean as mean
from jaxcomp._src.collectives import torus_allreduce as torus_allreduce
from jaxcomp._src.collectives import sparse_allgather as sparse_allgather
from jaxcomp._src.collectives import allgather as allgather
from jaxcomp._src.collectives import all_to_all as all_to_all
from jaxcomp._src.collectives import merge_topk as merge_topk
from jaxcomp._src.collectives import gtopk_allreduce as gtopk_allreduce
from jaxcomp._src.collectives import densify as densify

__all__ = (
    "all_to_all",
    "allgather",
    "allgather_chunks",
    "densify",
    "EMPTY_INDEX",
    "gtopk_allreduce",
    "mean",
    "merge_topk",
    "reduce_scatter",
    "reduce_sum",
    "sparse_allgather",
    "torus_allreduce",
)
