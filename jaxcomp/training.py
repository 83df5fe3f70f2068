"""Data-parallel training around jaxcomp compressors: layout, steps, FSDP, checkpoints.

* Layout: :func:`make_mesh`, :func:`replicate`, :func:`shard`, and the one
  per-device layout of a compressor's state (:func:`init_state`,
  :func:`per_device` for a hand-written ``shard_map``).
* Steps: :func:`make_step` (a jitted ``shard_map`` step that skips non-finite
  steps on every device alike), :func:`make_update`, :func:`make_pmap_step`.
* Buckets in the order the backward pass makes the gradients:
  :func:`backward_order`, :func:`with_bucket_order`.
* FSDP: :func:`shard_params`, :func:`init_fsdp_state`, :func:`make_fsdp_step`.
* Low-communication training (DiLoCo, Streaming DiLoCo): :func:`make_diloco_step`.
* Checkpoints: :func:`save_checkpoint`, :func:`restore_checkpoint`.
* The large-batch recipe: :func:`batch_size_schedule`,
  :func:`batch_scaled_learning_rate`, :func:`compile_batch_sizes`.
"""

from jaxcomp._src.layout import make_mesh as make_mesh
from jaxcomp._src.layout import mesh_axes as mesh_axes
from jaxcomp._src.layout import num_replicas as num_replicas
from jaxcomp._src.layout import replicate as replicate
from jaxcomp._src.layout import shard as shard
from jaxcomp._src.layout import stack_per_device as stack_per_device
from jaxcomp._src.layout import per_device_shape as per_device_shape
from jaxcomp._src.layout import tile_per_device as tile_per_device
from jaxcomp._src.layout import blocks_to_local as blocks_to_local
from jaxcomp._src.layout import local_to_blocks as local_to_blocks
from jaxcomp._src.layout import is_blocks_of as is_blocks_of
from jaxcomp._src.layout import init_state as init_state
from jaxcomp._src.layout import device_rows as device_rows
from jaxcomp._src.layout import local_state as local_state
from jaxcomp._src.layout import check_replicas as check_replicas
from jaxcomp._src.layout import per_device as per_device
from jaxcomp._src.layout import PerDeviceState as PerDeviceState
from jaxcomp._src.steps import LossFn as LossFn
from jaxcomp._src.steps import make_update as make_update
from jaxcomp._src.steps import make_step as make_step
from jaxcomp._src.steps import FormedStep as FormedStep
from jaxcomp._src.steps import make_pmap_step as make_pmap_step
from jaxcomp._src.steps import pmap_stack as pmap_stack
from jaxcomp._src.steps import init_pmap_state as init_pmap_state
from jaxcomp._src.backward import backward_order as backward_order
from jaxcomp._src.protocol import with_bucket_order as with_bucket_order
from jaxcomp._src.fsdp import shard_shapes as shard_shapes
from jaxcomp._src.fsdp import shard_params as shard_params
from jaxcomp._src.fsdp import gather_params as gather_params
from jaxcomp._src.fsdp import init_fsdp_state as init_fsdp_state
from jaxcomp._src.fsdp import make_fsdp_step as make_fsdp_step
from jaxcomp._src.fsdp import fsdp_transfers as fsdp_transfers
from jaxcomp._src.diloco import DiLoCoState as DiLoCoState
from jaxcomp._src.diloco import DiLoCoStep as DiLoCoStep
from jaxcomp._src.diloco import DiLoCoTransfers as DiLoCoTransfers
from jaxcomp._src.diloco import FragmentState as FragmentState
from jaxcomp._src.diloco import fragments as diloco_fragments
from jaxcomp._src.diloco import make_diloco_step as make_diloco_step
from jaxcomp._src.diloco import transfers as diloco_transfers
from jaxcomp._src.checkpoint import save_checkpoint as save_checkpoint
from jaxcomp._src.checkpoint import restore_checkpoint as restore_checkpoint
from jaxcomp._src.large_batch import BatchSizeSchedule as BatchSizeSchedule
from jaxcomp._src.large_batch import batch_size_schedule as batch_size_schedule
from jaxcomp._src.large_batch import check_batch_sizes as check_batch_sizes
from jaxcomp._src.large_batch import compile_batch_sizes as compile_batch_sizes
from jaxcomp._src.large_batch import batch_scaled_learning_rate as batch_scaled_learning_rate

__all__ = (
    "backward_order",
    "batch_scaled_learning_rate",
    "batch_size_schedule",
    "BatchSizeSchedule",
    "blocks_to_local",
    "check_batch_sizes",
    "check_replicas",
    "compile_batch_sizes",
    "device_rows",
    "diloco_fragments",
    "diloco_transfers",
    "DiLoCoState",
    "DiLoCoStep",
    "DiLoCoTransfers",
    "FragmentState",
    "fsdp_transfers",
    "gather_params",
    "init_fsdp_state",
    "init_pmap_state",
    "init_state",
    "is_blocks_of",
    "local_state",
    "local_to_blocks",
    "LossFn",
    "make_diloco_step",
    "make_fsdp_step",
    "make_mesh",
    "make_pmap_step",
    "make_step",
    "FormedStep",
    "make_update",
    "mesh_axes",
    "num_replicas",
    "per_device",
    "per_device_shape",
    "PerDeviceState",
    "pmap_stack",
    "replicate",
    "restore_checkpoint",
    "save_checkpoint",
    "shard",
    "shard_params",
    "shard_shapes",
    "stack_per_device",
    "tile_per_device",
    "with_bucket_order",
)
