"""Local top-k selection: which entries of a flat bucket a device sends."""

from jaxcomp._src.native import available as native_available
from jaxcomp._src.native import sent_mask as native_sent_mask
from jaxcomp._src.native import sampled_topk as native_sampled_topk
from jaxcomp._src.native import topk as native_topk
from jaxcomp._src.native import topk_per_row as native_topk_per_row
from jaxcomp._src.native import unavailable_reason as native_unavailable_reason
from jaxcomp._src.selection import Tuning as Tuning
from jaxcomp._src.selection import native_route as native_route
from jaxcomp._src.selection import tuning_for as tuning_for
from jaxcomp._src.selection import topk as topk
from jaxcomp._src.selection import select_topk as select_topk
from jaxcomp._src.selection import exact_topk as exact_topk
from jaxcomp._src.selection import sampled_topk as sampled_topk
from jaxcomp._src.selection import sample_size as sample_size
from jaxcomp._src.selection import candidate_capacity as candidate_capacity
from jaxcomp._src.selection import chunked_length as chunked_length
from jaxcomp._src.selection import exact_sample_ratio as exact_sample_ratio
from jaxcomp._src.selection import shared_length as shared_length
from jaxcomp._src.selection import topk_per_row as topk_per_row
from jaxcomp._src.selection import topk_per_row_of_product as topk_per_row_of_product

__all__ = (
    "candidate_capacity",
    "chunked_length",
    "exact_sample_ratio",
    "exact_topk",
    "native_available",
    "native_route",
    "native_sampled_topk",
    "native_sent_mask",
    "native_topk",
    "native_topk_per_row",
    "native_unavailable_reason",
    "sample_size",
    "sampled_topk",
    "select_topk",
    "shared_length",
    "topk",
    "topk_per_row",
    "topk_per_row_of_product",
    "Tuning",
    "tuning_for",
)
