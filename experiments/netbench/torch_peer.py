"""The peer: the same gradient exchange through PyTorch DDP over gloo and its comm hooks.

``python -m experiments.netbench.torch_peer SPEC.json`` (needs the ``peers``
extra, ``torch``). The model holds parameters of the same shapes as the JAX
workers' gradients, in PyTorch's layout (:func:`workload.torch_layout`); its
"loss" is ``sum_i <p_i, g_i>`` with ``g_i`` this worker's Gaussian gradient,
so backward writes exactly ``g`` into every ``.grad`` at the cost of one pass,
and DDP exchanges it. All parameters sit in one DDP bucket (``bucket_cap_mb``
above the model size, which also makes DDP's first bucket as large):
torch's ``powerSGD_hook`` over gloo hung with several buckets.

Rows:
  * ``torch_allreduce``: DDP's own all-reduce (no hook).
  * ``torch_fp16``: ``default_hooks.fp16_compress_hook``.
  * ``torch_powersgd``: ``powerSGD_hook`` at the rank of jaxcomp's
    ``powersgd``, error feedback and warm start on, ``start_powerSGD_iter``
    reached during the warm-up steps.

A step is forward plus backward (with the exchange). The compute is the same
step of a DDP model over this worker alone (a gloo group of one, the same
hook): forward, backward and the hook's compression without the network,
timed on all workers at once, as the JAX workers measure theirs. Like them it
compiles nothing per bandwidth: one phase per bandwidth (see
:func:`workload.wait_for_phase`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sys
import time
import traceback

# The peer runs on the CPU: a torch that sees a GPU makes DDP fail on CPU
# tensors ("Expected a cuda device, but got: cpu"). Hidden before torch is
# imported (in run), whatever environment the peer was started with.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402

from experiments.netbench import workload  # noqa: E402

START_POWERSGD_ITER = 2


def run(spec: dict) -> dict:
  import jax
  import torch
  import torch.distributed as dist
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
  from torch.nn.parallel import DistributedDataParallel

  rank = spec["process_id"]
  dist.init_process_group(
      "gloo", rank=rank, world_size=spec["num_processes"],
      init_method=f"tcp://{spec['coordinator']}",
      timeout=datetime.timedelta(seconds=spec["init_timeout_s"]),
  )
  shapes = jax.tree.leaves(workload.gradient_shapes(spec["model"], spec["size"]))
  generator = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
  sizes = [workload.torch_layout(tuple(s.shape)) for s in shapes]
  fixed = [1e-2 * torch.randn(size, generator=generator) for size in sizes]

  class Model(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.weights = torch.nn.ParameterList(
          [torch.nn.Parameter(torch.zeros(size)) for size in sizes])

    def forward(self):
      return sum((p * g).sum() for p, g in zip(self.weights, fixed))

  def ddp(group):
    """A fresh model under DDP over ``group`` (None: every worker), its hook registered."""
    model = Model()
    model_mb = sum(math.prod(size) for size in sizes) * 4 / 2**20
    wrapped = DistributedDataParallel(model, bucket_cap_mb=math.ceil(model_mb) + 1,
                                      broadcast_buffers=False, process_group=group)
    if method == "torch_fp16":
      wrapped.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif method == "torch_powersgd":
      state = powerSGD_hook.PowerSGDState(
          process_group=group,
          matrix_approximation_rank=spec["config"]["rank"],
          start_powerSGD_iter=START_POWERSGD_ITER,
          min_compression_rate=spec["config"].get("min_compression_rate", 2.0),
          use_error_feedback=True,
          warm_start=True,
      )
      wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model, wrapped

  def timed(module, count):
    times = []
    for _ in range(count):
      module.zero_grad(set_to_none=False)
      dist.barrier()
      start = time.perf_counter()
      module().backward()
      times.append(time.perf_counter() - start)
    return times

  method = spec["method"]
  if method not in workload.TORCH_TWINS:
    raise ValueError(f"unknown torch method {method!r}")
  # Every worker makes every group, in the same order (torch's rule).
  alone = [dist.new_group([r]) for r in range(spec["num_processes"])][rank]
  model, everyone = ddp(None)
  warmup = max(spec["warmup"], START_POWERSGD_ITER + 1)
  for phase in range(spec["phases"]):
    workload.wait_for_phase(spec["sync_dir"], phase, spec["phase_timeout_s"])
    timed(everyone, warmup)
    # Read between line-ups, as the JAX workers do: by then every byte of the
    # steps before has crossed this worker's eth0.
    dist.barrier()
    sent_before = workload.tx_bytes(spec["interface"])
    times = timed(everyone, spec["steps"])
    dist.barrier()
    sent_after = workload.tx_bytes(spec["interface"])
    workload.write_json(workload.phase_result_path(spec["sync_dir"], rank, phase), {
        "step_times_s": times,
        "tx_bytes": None if sent_before is None else sent_after - sent_before,
    })
  digest = hashlib.sha256()
  for p in model.weights:
    digest.update(p.grad.detach().numpy().astype(np.float32).tobytes())
  buckets = everyone._get_ddp_logging_data().get("bucket_sizes", "")
  del model, everyone

  _, by_itself = ddp(alone)
  timed(by_itself, warmup)
  compute = timed(by_itself, spec["compute_steps"])
  dist.barrier()
  dist.destroy_process_group()
  return {
      "process": rank,
      "pid": os.getpid(),
      "compute_times_s": compute,
      "output_sha256": digest.hexdigest(),
      "ddp_bucket_sizes": buckets,
      "torch_version": torch.__version__,
  }


def main(argv) -> int:
  with open(argv[1]) as f:
    spec = json.load(f)
  try:
    result, status = run(spec), 0
  except Exception:  # the launcher records it in the JSON
    result, status = {"error": traceback.format_exc()}, 1
  workload.write_json(spec["out"], result)
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv))
