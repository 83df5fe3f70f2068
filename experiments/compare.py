"""Trains one model with every compressor and says what each costs.

  python -m experiments.compare            # --quick on digits: every registered method
  python -m experiments.compare --task text --methods allreduce,gtopk
  python -m experiments.compare --mesh 2x4 # the same on a 2D mesh (torus all-reduce)
  python -m experiments.compare --mesh 2x4 --layout fsdp  # FSDP: compression on the slow axis
  python -m experiments.compare --large-batch  # batch 1024, with and without the large-batch recipe

Every method trains the same model from the same initialisation on the same
batches, data-parallel over fake CPU devices through :mod:`jaxcomp.training`
(each device on its own shard of the batch), for the same number of steps
with the same learning-rate schedule. Written to ``--out``:

* ``compare.json``: the configuration and, per method, the final test
  accuracy and loss, ``bytes_per_step`` (what one device sends per step once
  any schedule is over, read from the compiled training step by
  :func:`jaxcomp.wire.collective_bytes`) and ``bytes_per_step_run_average``
  (the average over the run's steps: they differ for DGC, whose warm-up sends
  more), ``compression_ratio`` (``4 n`` over the bytes of one device's
  compressed message), the measured ``step_time_s`` and the cost model's
  ``predicted_step_s``, and the evaluation history;
* ``compare.md``: the same as a table, with each method's ratio to dense;
* ``accuracy_vs_step.png`` (``loss_vs_step.png`` for text) and
  ``accuracy_vs_bytes.png``.

With ``--layout fsdp`` (on a ``--mesh ROWSxCOLS``) the parameters are
sharded over the mesh's second axis, the fast one (inside a node), with
:func:`jaxcomp.training.shard_params`, and each compressor runs over the first
axis, the slow one (between nodes), on this device's shard of the gradient
(:func:`jaxcomp.training.make_fsdp_step`). The run writes
``compare_fsdp.json``, ``compare_fsdp.md`` and ``compare_fsdp_*.png`` instead,
and each method's row holds the bytes per step over each axis apart
(``bytes_by_axes``, read from the compiled step) beside what the wire formulas
say the step sends (``bytes_by_axes_formula``,
:func:`jaxcomp.training.fsdp_transfers`: :func:`jaxcomp.hierarchical`'s
around the same compressor, with the step's skip decision).

With ``--large-batch`` it trains digits at a global batch of 1,024 with and
without the 2D-torus paper's large-batch recipe (batch-size control and
label smoothing, :func:`jaxcomp.training.batch_size_schedule` and
``optax.smooth_labels``), each part alone, and the
batch of 256 for reference, over ``--repeats`` seeds, and writes
``large_batch.md`` and ``large_batch.json`` (see :data:`LARGE_BATCH`).
"""

from __future__ import annotations

import argparse
import dataclasses
from fractions import Fraction
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import compute
from experiments import data
from experiments import models
from jaxcomp import costmodel
from jaxcomp import registry
from jaxcomp import training
from jaxcomp import wire

ALL_METHODS = registry.names()
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"

# Per task: the model, the batch, the steps, the schedule, and per method the
# compressor's configuration, the optimizer after it and, for DGC, the share
# of the steps its density warm-up takes (`warmup_fraction`, turned into
# `warmup_steps` for the run's step count: the DGC paper warms up over the
# first 4 of 90 epochs). The digits settings were chosen on the validation
# split (`--evaluate-on validation`), never on the test split: with plain SGD
# after them top-k and gTop-k at density 0.01 reached 96.2% and 95.1% against
# dense's 97.6%, random-k at 0.01 94.8%; with momentum 0.9, top-k 97.6%,
# gTop-k 96.9%; random-k at 0.05 with momentum 0.5 97.6%; signSGD 95.5% with
# plain SGD, 9.7% (diverged) with momentum 0.9 and 96.5% with 0.5. Against
# dense's 97.6% on the same split: DGC at density 0.001 with its warm-up over
# the first 5% of the steps 96.9%, QSGD at 8 levels with momentum 0.9 97.2%;
# DeMo at 2 of 64 coefficients with its default decay 0.999 and momentum 0.9
# after it reached 90.8% in a main-job run (test split, seen once, before
# tuning); on the validation split, with plain SGD after it 95.8%, with decay
# 0.9 and momentum 0.9 97.2%, at 8 of 64 98.3%.
# The text settings copy them, untuned.
_DIGITS_METHODS = {
    "allreduce": {"compressor": {}, "momentum": 0.9},
    "cast": {"compressor": {"dtype": "bfloat16"}, "momentum": 0.9},
    "topk": {"compressor": {"density": 0.01}, "momentum": 0.9},
    "gtopk": {"compressor": {"density": 0.01}, "momentum": 0.9},
    "randomk": {"compressor": {"density": 0.05}, "momentum": 0.5},
    "dgc": {"compressor": {"density": 0.001, "momentum": 0.9, "sparse_leaves": "all"},
            "momentum": 0.0, "warmup_fraction": 0.05},
    "signsgd": {"compressor": {}, "momentum": 0.5},
    "qsgd": {"compressor": {"levels": 8}, "momentum": 0.9},
    "quantized": {"compressor": {"bits": 8}, "momentum": 0.9},
    "sparseloco": {"compressor": {"density": 1 / 64}, "momentum": 0.9},
    "demo": {"compressor": {"density": 1 / 32, "error_decay": 0.9}, "momentum": 0.9},
    "powersgd": {"compressor": {"rank": 2}, "momentum": 0.9},
    "acpsgd": {"compressor": {"rank": 2}, "momentum": 0.9},
}
TASKS: dict[str, dict[str, Any]] = {
    "digits": {
        "batch_per_device": 32,
        "quick_steps": 600,
        "full_steps": 2000,
        "eval_every": 50,
        "peak_lr": 0.1,
        "warmup_fraction": 0.05,
        "methods": _DIGITS_METHODS,
    },
    "text": {
        "batch_per_device": 16,
        "context": 64,
        "quick_steps": 200,
        "full_steps": 3000,
        "eval_every": 50,
        "peak_lr": 0.3,
        "warmup_fraction": 0.05,
        "methods": {
            **_DIGITS_METHODS,
            # The paper's rule: only tensors of rank > 1 sparse.
            "dgc": {"compressor": {"density": 0.001, "momentum": 0.9}, "momentum": 0.0,
                    "warmup_fraction": 0.05},
            "powersgd": {"compressor": {"rank": 4}, "momentum": 0.9},
            "acpsgd": {"compressor": {"rank": 4}, "momentum": 0.9},
        },
    },
}

GOAL_DENSE_ACCURACY = 0.95
GOAL_POINTS_FROM_DENSE = 2.0
GOAL_DGC_DENSITY = 0.001
GOAL_DGC_RATIO = 300.0


@dataclasses.dataclass(frozen=True)
class Config:
  """One run of the comparison."""
  task: str = "digits"
  methods: tuple[str, ...] = ALL_METHODS
  steps: int = 600
  devices: int = 8
  mesh: Optional[tuple[int, int]] = None
  eval_every: int = 50
  evaluate_on: str = "test"
  bandwidth_gbit: float = 1.0
  latency_us: float = 50.0
  seed: int = 0
  out: str = str(RESULTS_DIR)
  progress: bool = True
  mode: str = "quick"
  layout: str = "replicated"
  large_batch: bool = False
  repeats: int = 1

  @property
  def axis_name(self):
    return "data" if self.mesh is None else ("x", "y")

  @property
  def slow_axis(self) -> str:
    """FSDP: the axis between nodes, where the compressor runs (the mesh's first)."""
    return self.axis_name[0]

  @property
  def fast_axis(self) -> str:
    """FSDP: the axis inside a node, over which the parameters are sharded (the second)."""
    return self.axis_name[1]

  @property
  def num_devices(self):
    """What the wire formulas and the cost model take: P, or (rows, cols)."""
    return self.devices if self.mesh is None else tuple(self.mesh)


# --------------------------------------------------------------- the pieces


def _schedule(task: dict, steps: int) -> optax.Schedule:
  warmup = max(1, int(task["warmup_fraction"] * steps))
  return optax.warmup_cosine_decay_schedule(
      0.0, task["peak_lr"], warmup_steps=warmup, decay_steps=steps
  )


def _compressor_config(method: dict, steps: int) -> dict:
  """The compressor's arguments in a run of ``steps`` steps (``warmup_fraction`` as steps)."""
  config = dict(method["compressor"])
  if "warmup_fraction" in method:
    config["warmup_steps"] = max(1, int(method["warmup_fraction"] * steps))
  return config


def _chain(name: str, axis_name, compressor_config: dict, momentum: float,
           schedule) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
  """``(compressor, chain)``: the compressor, then SGD with ``momentum`` (0: none)."""
  compressor = registry.build(name, axis_name, **compressor_config)
  return compressor, optax.chain(compressor, optax.sgd(schedule, momentum=momentum or None))


def _describe(name: str, compressor_config: dict, momentum: float) -> dict:
  """The full configuration of a method, with the defaults it did not override."""
  return {
      "compressor": registry.configuration(name, **compressor_config),
      "optimizer": f"sgd(momentum={momentum})" if momentum else "sgd (no momentum)",
  }


def message_bytes(name: str, compressor_config: dict, params) -> float:
  """Bytes of one device's compressed message per step, from the method's own formula.

  Its wire formula at P = 2, where each device sends exactly its message to
  the one other device: an all-reduce of a buffer of ``s`` bytes sends ``s``,
  an all-gather sends the device's own part, one butterfly round sends its
  ``k`` values and indices, and ACP-SGD's alternation averages its P and Q
  messages. Leaves a method sends dense count in full; a schedule counts
  once it is over (DGC after its warm-up).
  """
  tx = registry.build(name, "data", **compressor_config)
  return float(wire.expected_bytes(tx, params, 2).total)


def program_bytes(measured: wire.WireBytes, formula: wire.WireCost,
                  by: str = "kind") -> dict[Any, Fraction]:
  """Bytes per step of a compiled program by kind, its switch branches weighted as ``formula``'s.

  :func:`jaxcomp.wire.collective_bytes` weights each of a switch's ``B``
  branches ``1 / B``; a schedule spends other shares of the steps in them
  (DGC: none in its warm-up stages once the warm-up is over), which the
  formula's transfers carry. Collectives outside any branch keep their
  weight. ``by="axes"``: by the mesh axes each collective spans instead
  (``measured`` read with ``mesh_shape``).
  """
  shares = {t.branch: t.weight for t in formula if t.branch is not None}
  totals: dict[Any, Fraction] = {}
  for op in measured.ops:
    sent = op.bytes * (op.weight if op.branch is None else shares[op.branch])
    if sent:
      key = getattr(op, by)
      totals[key] = totals.get(key, Fraction(0)) + sent
  return totals


def _task_data(task_name: str, evaluate_on: str):
  if task_name == "digits":
    return data.digits(evaluate_on)
  return data.text(evaluate_on)


def _model(task_name: str, task: dict, seed: int) -> models.Model:
  if task_name == "digits":
    return models.digits_cnn(seed)
  return models.char_transformer(seed, context=task["context"])


def _batches(task_name: str, task: dict, dataset, global_batch: int, seed: int):
  if task_name == "digits":
    return data.image_batches(dataset.train, global_batch, seed)
  return data.text_batches(dataset.train, global_batch, task["context"], seed)


def _eval_arrays(task_name: str, task: dict, dataset):
  if task_name == "digits":
    return jnp.asarray(dataset.eval.x), jnp.asarray(dataset.eval.y)
  x, y = data.text_eval_windows(dataset.eval, task["context"])
  return jnp.asarray(x), jnp.asarray(y)


# ------------------------------------------------------------------ training


def train_method(name: str, config: Config, task: dict, model: models.Model, dataset,
                 mesh, schedule, eval_x, eval_y) -> dict:
  """Trains ``model`` with one compressor; returns its row of ``compare.json``."""
  method = task["methods"][name]
  compressor_config = _compressor_config(method, config.steps)
  compressor, tx = _chain(name, config.axis_name, compressor_config, method["momentum"], schedule)
  global_batch = task["batch_per_device"] * config.devices
  batches = _batches(config.task, task, dataset, global_batch, config.seed)
  params = training.replicate(model.params, mesh)
  opt_state = training.init_state(tx, params, mesh, config.axis_name)
  step = training.make_step(model.loss, tx, mesh, config.axis_name)
  host_batch = next(batches)
  local_batch = jax.tree.map(lambda x: x[: task["batch_per_device"]], host_batch)
  first = training.shard(host_batch, mesh, config.axis_name)
  compiled = step.lower(params, opt_state, first).compile()
  measured = wire.collective_bytes(compiled)
  steady = wire.transfers(compressor, model.params, config.num_devices)
  sent = program_bytes(measured, steady)
  sent_over_run = program_bytes(
      measured, wire.transfers(compressor, model.params, config.num_devices, steps=config.steps))
  evaluate = jax.jit(model.evaluate)
  history, times, skipped = _train_loop(
      name, config, compiled, params, opt_state, first,
      lambda: training.shard(next(batches), mesh, config.axis_name),
      lambda params: evaluate(params, eval_x, eval_y))

  _, one_device_tx = _chain(name, "data", compressor_config, method["momentum"], schedule)
  compute_s = compute.measure_step(model.loss, one_device_tx, model.params, local_batch)
  n = models.num_params(model.params)
  message = message_bytes(name, compressor_config, model.params)
  exchange = costmodel.exchange_time(steady, config.bandwidth_gbit, config.latency_us)
  predicted = costmodel.predict(
      compressor, model.params, config.num_devices, config.bandwidth_gbit,
      config.latency_us, compute_s=compute_s,
  )
  final = history[-1]
  return {
      "final_accuracy": final["eval_accuracy"],
      "final_loss": final["eval_loss"],
      "bits_per_char": final["eval_loss"] / math.log(2) if config.task == "text" else None,
      "bytes_per_step": float(sum(sent.values())),
      "bytes_per_step_formula": float(wire.expected_bytes(
          compressor, model.params, config.num_devices).total),
      "bytes_per_step_run_average": float(sum(sent_over_run.values())),
      "bytes_per_step_run_average_formula": float(wire.expected_bytes(
          compressor, model.params, config.num_devices, steps=config.steps).total),
      "bytes_by_kind": {k: float(v) for k, v in sent.items()},
      "message_bytes": message,
      "compression_ratio": 4 * n / message,
      # The second half: the first steps of a process run slower (thread pools
      # and caches warming up), which would bias whichever method runs first.
      "step_time_s": statistics.median(times[len(times) // 2:]),
      "compute_s": compute_s,
      "exchange_s": exchange,
      "predicted_step_s": predicted,
      "skipped_steps": skipped,
      "configuration": _describe(name, compressor_config, method["momentum"]),
      "history": history,
  }


def _train_loop(name: str, config: Config, compiled, params, opt_state, first,
                next_batch, evaluate) -> tuple[list[dict], list[float], int]:
  """``config.steps`` steps of ``compiled``; returns the evaluation history, step times, skips.

  Every step is waited for: XLA:CPU aborts a collective's rendezvous after
  40 s, which many queued steps of 8 fake devices on 2 cores can reach.
  """
  history = []
  times = []
  skipped = 0
  batch = first
  progress = _progress(name, config)
  for i in range(config.steps):
    start = time.perf_counter()
    params, opt_state, metrics = compiled(params, opt_state, batch)
    loss = np.asarray(metrics["loss"])  # on the host: a sync, and no program per reduction
    times.append(time.perf_counter() - start)
    skipped += int(not np.asarray(metrics["finite"])[0])
    if (i + 1) % config.eval_every == 0 or i + 1 == config.steps:
      eval_loss, eval_accuracy = evaluate(params)
      history.append({
          "step": i + 1, "train_loss": float(np.mean(loss)),
          "eval_loss": float(eval_loss), "eval_accuracy": float(eval_accuracy),
      })
    progress.update(1)
    if i % 10 == 0:
      progress.set_postfix(loss=f"{float(np.mean(loss)):.3f}")
    if i + 1 < config.steps:
      batch = next_batch()
  progress.close()
  return history, times, skipped


def _axes_key(axes: tuple[str, ...]) -> str:
  """A JSON key for a set of mesh axes: ``"x"``, ``"y"``, ``"x+y"``."""
  return "+".join(axes)


def train_method_fsdp(name: str, config: Config, task: dict, model: models.Model, dataset,
                      mesh, schedule, eval_x, eval_y) -> dict:
  """Trains ``model`` with one compressor on the FSDP layout; returns its row of the JSON.

  Parameters in row blocks over the fast axis, the compressor over the slow
  axis on this device's shard of the gradient, the same optimizer after it as
  in the replicated layout. Bytes are read per axis from the compiled step and
  set beside :func:`jaxcomp.training.fsdp_transfers`: the fast-axis
  reduce-scatter and all-gather of :func:`jaxcomp.hierarchical` around the
  same compressor are the gradient's reduce-scatter and the parameters'
  all-gather here, and the step's skip decision is an int32 all-reduce over
  both axes.
  """
  method = task["methods"][name]
  compressor_config = _compressor_config(method, config.steps)
  slow, fast = config.slow_axis, config.fast_axis
  compressor, tx = _chain(name, slow, compressor_config, method["momentum"], schedule)
  global_batch = task["batch_per_device"] * config.devices
  batches = _batches(config.task, task, dataset, global_batch, config.seed)
  params = training.shard_params(model.params, mesh, fast)
  opt_state = training.init_fsdp_state(tx, model.params, mesh, slow, fast)
  step = training.make_fsdp_step(model.loss, tx, mesh, slow, fast, like=model.params)
  first = training.shard(next(batches), mesh, config.axis_name)
  compiled = step.lower(params, opt_state, first).compile()
  mesh_shape = dict(mesh.shape)
  measured = wire.collective_bytes(compiled, mesh_shape=mesh_shape)
  by_axes = {}
  for label, steps in (("", None), ("_run_average", config.steps)):
    formula = training.fsdp_transfers(compressor, model.params, mesh_shape, slow, fast,
                                      steps=steps)
    program = program_bytes(measured, formula, by="axes")
    expected = wire.tally(formula).by_axes
    by_axes["bytes_by_axes" + label] = {_axes_key(a): float(v) for a, v in program.items()}
    by_axes["bytes_by_axes" + label + "_formula"] = {
        _axes_key(a): float(v) for a, v in expected.items()}
    # Program less formula on each axis: empty when they agree exactly.
    by_axes["formula_mismatch" + label] = {
        _axes_key(a): float(program.get(a, 0) - expected.get(a, 0))
        for a in sorted(set(program) | set(expected))
        if program.get(a, 0) != expected.get(a, 0)}
  evaluate = jax.jit(
      lambda shard, x, y: model.evaluate(training.gather_params(shard, model.params), x, y))
  history, times, skipped = _train_loop(
      name, config, compiled, params, opt_state, first,
      lambda: training.shard(next(batches), mesh, config.axis_name),
      lambda shard: evaluate(shard, eval_x, eval_y))

  shards = training.shard_shapes(model.params, mesh_shape[fast])
  message = message_bytes(name, compressor_config, shards)
  final = history[-1]
  program_axes = by_axes["bytes_by_axes"]
  return {
      "final_accuracy": final["eval_accuracy"],
      "final_loss": final["eval_loss"],
      "bits_per_char": final["eval_loss"] / math.log(2) if config.task == "text" else None,
      "slow_bytes_per_step": program_axes.get(slow, 0.0),
      "fast_bytes_per_step": program_axes.get(fast, 0.0),
      "both_axes_bytes_per_step": program_axes.get(_axes_key(tuple(mesh.axis_names)), 0.0),
      "slow_bytes_per_step_run_average": by_axes["bytes_by_axes_run_average"].get(slow, 0.0),
      **by_axes,
      "message_bytes": message,
      # Of one device's shard: 4 S over the bytes of its compressed message.
      "compression_ratio": 4 * models.num_params(shards) / message,
      "step_time_s": statistics.median(times[len(times) // 2:]),
      "skipped_steps": skipped,
      "configuration": _describe(name, compressor_config, method["momentum"]),
      "history": history,
  }


def _progress(name: str, config: Config):
  from tqdm import auto as tqdm_auto

  return tqdm_auto.tqdm(
      total=config.steps, desc=f"{name:>9s}", unit="step", disable=not config.progress,
      file=sys.stderr, dynamic_ncols=True,
  )


# -------------------------------------------------------------------- a run


def ensure_devices(count: int) -> None:
  """Asks for ``count`` fake CPU devices (only possible before JAX starts)."""
  try:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    pass  # the backend is up already (a test session): use what it has
  if len(jax.devices()) < count:
    raise SystemExit(
        f"--devices {count} needs {count} devices, JAX has {len(jax.devices())}"
    )


class _RunClock:
  """Wall and CPU time and load average of one run, from its start."""

  def __init__(self):
    self.started = time.perf_counter()
    self.cpu_started = time.process_time()
    self.load_started = os.getloadavg()[0]

  def record(self) -> dict:
    """The run's timing and versions, as its JSON's ``config`` holds them."""
    return {
        "wall_time_s": time.perf_counter() - self.started,
        "process_cpu_s": time.process_time() - self.cpu_started,
        "cpu_count": os.cpu_count(),
        "load_average_1min": [self.load_started, os.getloadavg()[0]],
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
    }


def run(config: Config) -> dict:
  """Trains every method of ``config`` and writes the results; returns ``compare.json``'s dict."""
  ensure_devices(config.devices)
  clock = _RunClock()
  task = TASKS[config.task]
  dataset = _task_data(config.task, config.evaluate_on)
  model = _model(config.task, task, config.seed)
  schedule = _schedule(task, config.steps)
  if config.mesh is None:
    mesh = training.make_mesh(config.devices)
  else:
    mesh = training.make_mesh(config.mesh, config.axis_name)
  eval_x, eval_y = _eval_arrays(config.task, task, dataset)
  train = train_method_fsdp if config.layout == "fsdp" else train_method
  results = {
      name: train(name, config, task, model, dataset, mesh, schedule, eval_x, eval_y)
      for name in config.methods
  }
  report = {
      "config": {
          "task": config.task,
          "mode": config.mode,
          "model": model.description,
          "num_params": models.num_params(model.params),
          "steps": config.steps,
          "devices": config.devices,
          "mesh": list(config.mesh) if config.mesh else None,
          "axis_name": list(config.axis_name) if config.mesh else config.axis_name,
          "layout": config.layout,
          **({"slow_axis": config.slow_axis, "fast_axis": config.fast_axis}
             if config.layout == "fsdp" else {}),
          "batch_per_device": task["batch_per_device"],
          "global_batch": task["batch_per_device"] * config.devices,
          "schedule": (
              f"linear warm-up over {max(1, int(task['warmup_fraction'] * config.steps))}"
              f" steps to {task['peak_lr']}, cosine decay to 0 at step {config.steps}"
          ),
          "evaluated_on": dataset.eval_name,
          "train_examples": len(dataset.train),
          "eval_examples": len(dataset.eval),
          "bandwidth_gbit": config.bandwidth_gbit,
          "latency_us": config.latency_us,
          "seed": config.seed,
          **clock.record(),
      },
      "methods": results,
  }
  report["goals"] = check_goals(report) if config.task == "digits" else []
  write(report, pathlib.Path(config.out))
  return report


# ----------------------------------------------------------------- outputs


def check_goals(report: dict) -> list[dict]:
  """The issue's goals for the digits run, each with whether it is met."""
  methods = report["methods"]
  goals = []
  if report["config"].get("layout") == "fsdp" and methods:
    mismatched = [name for name, row in methods.items() if row["formula_mismatch"]]
    goals.append({
        "goal": "every method's program bytes on each axis equal the formula"
                " (training.fsdp_transfers)",
        "met": not mismatched, "value": len(mismatched),
    })
  if "allreduce" not in methods:
    return goals
  dense = methods["allreduce"]["final_accuracy"]
  goals.append({
      "goal": f"allreduce {report['config']['evaluated_on']} accuracy >= {GOAL_DENSE_ACCURACY}",
      "met": dense >= GOAL_DENSE_ACCURACY, "value": dense,
  })
  for name, row in methods.items():
    if name == "allreduce":
      continue
    gap = 100 * (dense - row["final_accuracy"])
    goals.append({
        "goal": f"{name} within {GOAL_POINTS_FROM_DENSE} points of allreduce",
        "met": gap <= GOAL_POINTS_FROM_DENSE, "value": 0.0 - gap,
    })
  if "dgc" in methods:
    row = methods["dgc"]
    density = row["configuration"]["compressor"]["density"]
    goals.append({
        "goal": f"dgc density <= {GOAL_DGC_DENSITY} after warm-up",
        "met": density <= GOAL_DGC_DENSITY, "value": density,
    })
    goals.append({
        "goal": f"dgc compression_ratio >= {GOAL_DGC_RATIO:g}",
        "met": row["compression_ratio"] >= GOAL_DGC_RATIO, "value": row["compression_ratio"],
    })
  return goals


def _format_config(configuration: dict) -> str:
  compressor = ", ".join(f"{k}={v}" for k, v in configuration["compressor"].items())
  return f"{compressor or '-'}; then {configuration['optimizer']}"


def _ratio(value: float, dense: Optional[float]) -> str:
  return f"{value / dense:.3g}x" if dense else "-"


def _bytes_cell(row: dict) -> str:
  steady, average = row["bytes_per_step"], row["bytes_per_step_run_average"]
  return f"{steady:,.0f}" + (f" ({average:,.0f} over the run)" if average != steady else "")


def _dgc_note(row: dict, config: dict, dense: Optional[dict], link: str = "") -> str:
  """What DGC's configuration does, and what its schedule sends."""
  compressor = row["configuration"]["compressor"]
  leaves = (
      "every leaf in the sparse bucket (`sparse_leaves=\"all\"`)"
      if compressor.get("sparse_leaves") == "all"
      else "the paper's rule for the sparse bucket (tensors of rank > 1; biases and"
      " norms are averaged dense)"
  )
  note = (
      "- **dgc** runs with momentum correction and momentum-factor masking inside (so"
      f" plain SGD after it) and {leaves}."
  )
  warmup = compressor["warmup_steps"]
  if warmup:
    average = row["bytes_per_step_run_average"]
    note += (
        f" Its density warm-up is the paper's (there the first 4 of 90 epochs): over the"
        f" first {warmup} of {config['steps']} steps the density follows 25%, 6.25%,"
        f" 1.5625% and 0.4%, step t in stage floor(4 t / {warmup}), then stays at"
        f" {compressor['density']:g}. Each stage is one branch of a `lax.switch` on the"
        f" step count with its own static k, so each sends its own payload: after the"
        f" warm-up {row['bytes_per_step']:,.0f} bytes per step{link}, over the whole run"
        f" {average:,.0f} on average"
        + (f" ({dense['bytes_per_step'] / average:.0f}x less than dense)" if dense else "")
        + "."
    )
  else:
    note += " It runs without a density warm-up (`warmup_steps=0`)."
  return note + " Its learning-rate warm-up is every method's."


def _mesh_description(config: dict) -> str:
  if not config["mesh"]:
    return ""
  rows, cols = config["mesh"]
  if config.get("layout") != "fsdp":
    return f" as a {rows}x{cols} mesh (2D torus)"
  return (
      f" as a {rows}x{cols} mesh in the FSDP layout: the parameters sharded in row blocks"
      f" over `{config['fast_axis']}` ({cols} devices, the fast axis, inside a node), each"
      f" compressor over `{config['slow_axis']}` ({rows} devices, the slow axis, between"
      " nodes) on this device's shard of the gradient")


def _header(report: dict) -> list[str]:
  """The title and the paragraph on the run: model, steps, devices, schedule, wall time."""
  config = report["config"]
  title = "Compressor comparison" + (", FSDP" if config.get("layout") == "fsdp" else "")
  return [
      f"# {title}: {config['task']} ({config['mode']})",
      "",
      f"{config['model']}, {config['num_params']:,} parameters; {config['steps']} steps of"
      f" {config['global_batch']} examples ({config['batch_per_device']} per device) on"
      f" {config['devices']} fake CPU devices"
      + _mesh_description(config)
      + f"; learning rate: {config['schedule']}, the same for every method."
      f" Evaluated on the {config['evaluated_on']} split ({config['eval_examples']} examples)."
      f" Wall time of the run: {config['wall_time_s']:.0f} s on {config['cpu_count']} cores"
      f" ({config['process_cpu_s']:.0f} s of CPU time; 1-minute load average"
      f" {config['load_average_1min'][0]:.1f} at the start"
      + (", above the core count: other jobs shared the cores"
         if config["load_average_1min"][0] > config["cpu_count"] else ", a quiet machine")
      + f"; {config['load_average_1min'][1]:.1f} at the end, the run's own threads"
      " included).",
  ]


def _goal_lines(report: dict) -> list[str]:
  if not report["goals"]:
    return []
  lines = ["", "## Goals", "", "| goal | value | met |", "|---|---|---|"]
  for goal in report["goals"]:
    lines.append(f"| {goal['goal']} | {goal['value']:.4g} | {'yes' if goal['met'] else 'NO'} |")
  return lines


def _quality(row: dict, dense: Optional[dict], text: bool) -> tuple[str, str]:
  """The method's test metric and its difference to dense's, as table cells."""
  if text:
    value = f"{row['bits_per_char']:.3f}"
    delta = f"{row['bits_per_char'] - dense['bits_per_char']:+.3f}" if dense else "-"
  else:
    value = f"{row['final_accuracy']:.4f}"
    delta = f"{100 * (row['final_accuracy'] - dense['final_accuracy']):+.1f} pt" if dense else "-"
  return value, delta


def _quality_columns(config: dict, methods: dict) -> tuple[Optional[dict], bool, str]:
  """The dense row, whether the task is text, and the quality column's heading."""
  text = config["task"] == "text"
  metric = f"{config['evaluated_on']} " + ("bits/char" if text else "accuracy")
  return methods.get("allreduce"), text, metric


def markdown(report: dict) -> str:
  """``compare.md``: the results as a table, with each method's ratio to dense."""
  if report["config"].get("layout") == "fsdp":
    return markdown_fsdp(report)
  config, methods = report["config"], report["methods"]
  dense, text, metric = _quality_columns(config, methods)
  lines = _header(report) + [
      "",
      f"| method | configuration | {metric} | vs dense | final loss | bytes/step"
      " | vs dense | compression ratio | step time (s) | vs dense | predicted step (s) | vs dense |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, row in methods.items():
    value, delta = _quality(row, dense, text)
    lines.append(
        f"| {name} | {_format_config(row['configuration'])} | {value} | {delta}"
        f" | {row['final_loss']:.4f} | {_bytes_cell(row)}"
        f" | {_ratio(row['bytes_per_step'], dense and dense['bytes_per_step'])}"
        f" | {row['compression_ratio']:.1f}"
        f" | {row['step_time_s']:.4f} | {_ratio(row['step_time_s'], dense and dense['step_time_s'])}"
        f" | {row['predicted_step_s']:.4f}"
        f" | {_ratio(row['predicted_step_s'], dense and dense['predicted_step_s'])} |"
    )
  lines += [
      "",
      "How to read it:",
      "",
      "- **bytes/step**: what one device sends per step once any schedule is over (DGC"
      " after its warm-up), read from the compiled training step's HLO by"
      " `jaxcomp.wire.collective_bytes` (ring formulas: all-reduce 2(P-1)/P of the"
      " buffer, all-gather (P-1)/P of the gathered buffer, a permute its operand), the"
      " branches of a schedule's `lax.switch` weighted by the share of the steps spent"
      " in each. A second figure in brackets is the average over the whole run"
      " (`bytes_per_step_run_average`), where a schedule makes it differ. Both equal"
      " the method's wire formula (`bytes_per_step_formula`,"
      " `bytes_per_step_run_average_formula` in compare.json).",
      "- **compression ratio**: 4n (the dense f32 gradient, n parameters) divided by the"
      " bytes of one device's compressed message per step: for the sparse methods its"
      " values and int32 indices (8 bytes per kept element; random-k sends values only,"
      " its indices come from a shared seed), plus every leaf the method sends dense;"
      " for the low-rank methods the factors (ACP-SGD: the mean of its P and Q steps);"
      " for signSGD the packed bits; for QSGD one int8 level per element and one f32"
      " norm per bucket; for the integer quantizer bits / 8 bytes per element and one"
      " f32 scale per block. It is computed from the method's configuration by"
      " its own wire formula at P = 2, where a device sends exactly its message once.",
      "- **step time**: the median wall time of one step over the second half of the"
      " run, 8 fake devices sharing the CPU cores, so collectives cost memory copies, not"
      " a network; it measures compression compute here, not communication.",
      *([_dgc_note(methods["dgc"], config, dense)] if "dgc" in methods else []),
      f"- **predicted step**: `jaxcomp.costmodel`: the method's step measured on one"
      f" device by `experiments.compute.measure_step` (forward, backward and"
      f" compression) plus the alpha-beta time of its collectives after any schedule"
      f" for P = {config['devices']} at {config['bandwidth_gbit']:g} Gbit/s and"
      f" {config['latency_us']:g} us per message.",
  ]
  lines += _goal_lines(report)
  return "\n".join(lines) + "\n"


def _axes_cell(by_axes: dict, order: tuple[str, ...]) -> str:
  """``x: 1,440; y: 430,824``: bytes per set of axes, in ``order`` (others after)."""
  keys = [k for k in order if k in by_axes] + sorted(k for k in by_axes if k not in order)
  return "; ".join(f"{k}: {by_axes[k]:,.0f}" for k in keys) or "-"


def markdown_fsdp(report: dict) -> str:
  """``compare_fsdp.md``: accuracy and the bytes over each link, with the ratio to dense."""
  config, methods = report["config"], report["methods"]
  slow, fast = config["slow_axis"], config["fast_axis"]
  rows, cols = config["mesh"]
  both = f"{slow}+{fast}"
  dense, text, metric = _quality_columns(config, methods)
  lines = _header(report) + [
      "",
      f"| method | configuration | {metric} | vs dense | slow-link bytes/step (`{slow}`)"
      f" | vs dense | fast-link bytes/step (`{fast}`) | both axes (`{both}`)"
      " | formula (per axis) | program = formula | step time (s) |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, row in methods.items():
    value, delta = _quality(row, dense, text)
    slow_bytes, average = row["slow_bytes_per_step"], row["slow_bytes_per_step_run_average"]
    mismatch = {**row["formula_mismatch"], **row["formula_mismatch_run_average"]}
    lines.append(
        f"| {name} | {_format_config(row['configuration'])} | {value} | {delta}"
        f" | {slow_bytes:,.0f}"
        + (f" ({average:,.0f} over the run)" if average != slow_bytes else "")
        + f" | {_ratio(slow_bytes, dense and dense['slow_bytes_per_step'])}"
        f" | {row['fast_bytes_per_step']:,.0f} | {row['both_axes_bytes_per_step']:,.0f}"
        f" | {_axes_cell(row['bytes_by_axes_formula'], (slow, fast, both))}"
        f" | {'yes' if not mismatch else 'NO, program less formula: ' + _axes_cell(mismatch, (slow, fast, both))}"
        f" | {row['step_time_s']:.4f} |"
    )
  lines += [
      "",
      "How to read it:",
      "",
      f"- **slow-link bytes/step**: what one device sends per step over `{slow}` (between"
      f" nodes), read from the compiled FSDP step's HLO by"
      " `jaxcomp.wire.collective_bytes(compiled, mesh_shape=...).by_axes`, each collective"
      " labelled by the mesh axes its device groups span (ring formulas: all-reduce"
      " 2(P-1)/P of the buffer, all-gather (P-1)/P of the gathered buffer, a permute its"
      " operand), a schedule's `lax.switch` branches weighted by the share of the steps in"
      " each (after the schedule; in brackets, the average over the run where it differs)."
      " It is the compressor's exchange of this device's shard, 1/"
      f"{cols} of the gradient; **vs dense** divides it by allreduce's.",
      f"- **fast-link bytes/step**: over `{fast}` (inside a node): the all-gather of the"
      " parameters' row blocks in the forward pass and the reduce-scatter of the gradient"
      f" that autodiff makes of it, each (X-1)/X of the X = {cols} padded row blocks in"
      " f32; the same for every method.",
      f"- **both axes**: the step's skip decision, one int32 all-reduce (`pmin` of"
      f" \"finite\") over all {rows * cols} devices: 2(P-1)/P of 4 bytes.",
      f"- **formula**: `jaxcomp.wire.tally(jaxcomp.training.fsdp_transfers(compressor,"
      f" params, mesh.shape, \"{slow}\", \"{fast}\")).by_axes`: the reduce-scatter and"
      f" all-gather on `{fast}` of `jaxcomp.hierarchical(compressor, \"{fast}\", {cols})`"
      f" are what the FSDP step's gradient reduce-scatter and parameter all-gather send,"
      f" its compressor runs on the same shard over `{slow}`, and the skip decision is"
      f" the all-reduce over both axes. **program = formula**: yes when the program's"
      " bytes on each axis equal the formula exactly, both after the schedule"
      " and averaged over the run; otherwise the difference (`formula_mismatch` and"
      " `formula_mismatch_run_average` in the JSON).",
      *([_dgc_note(_with_bytes(methods["dgc"]), config, _with_bytes(dense), " over the slow link")]
        if "dgc" in methods else []),
      "- **step time**: the median wall time of one step over the second half of the"
      f" run, {rows * cols} fake devices sharing the CPU cores: compression compute, not"
      " communication.",
  ]
  lines += _goal_lines(report)
  return "\n".join(lines) + "\n"


def _with_bytes(row: Optional[dict]) -> Optional[dict]:
  """An FSDP row with its slow-link bytes as the replicated rows' ``bytes_per_step``."""
  if row is None:
    return None
  return {**row, "bytes_per_step": row["slow_bytes_per_step"],
          "bytes_per_step_run_average": row["slow_bytes_per_step_run_average"]}


def plot(report: dict, out: pathlib.Path) -> list[pathlib.Path]:
  """The evaluation curve of every method, and final quality against bytes per step."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  methods = report["methods"]
  text = report["config"]["task"] == "text"
  fsdp = report["config"].get("layout") == "fsdp"
  prefix = "compare_fsdp_" if fsdp else ""
  sent = "slow_bytes_per_step_run_average" if fsdp else "bytes_per_step_run_average"
  key, label = ("eval_loss", "test loss (nats/char)") if text else ("eval_accuracy", "test accuracy")
  if report["config"]["evaluated_on"] != "test":
    label = label.replace("test", report["config"]["evaluated_on"])
  paths = []
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, row in methods.items():
    ax.plot([h["step"] for h in row["history"]], [h[key] for h in row["history"]], label=name)
  ax.set_xlabel("step")
  ax.set_ylabel(label)
  if not text:
    ax.set_ylim(0.7, 1.0)
  ax.grid(alpha=0.3)
  ax.legend(ncol=3, fontsize=8)
  ax.set_title(f"{report['config']['task']}: {label} against step")
  fig.tight_layout()
  paths.append(out / (prefix + ("loss_vs_step.png" if text else "accuracy_vs_step.png")))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, row in methods.items():
    value = row["final_loss"] if text else row["final_accuracy"]
    ax.scatter(row[sent], value)
    ax.annotate(name, (row[sent], value), textcoords="offset points",
                xytext=(4, 4), fontsize=8)
  ax.set_xscale("log")
  ax.set_xlabel(("slow-link " if fsdp else "")
                + "bytes sent per device per step, averaged over the run (log scale)")
  ax.set_ylabel("final " + label)
  ax.grid(alpha=0.3, which="both")
  ax.set_title(f"{report['config']['task']}: final {label} against bytes per step")
  fig.tight_layout()
  paths.append(out / (prefix + ("loss_vs_bytes.png" if text else "accuracy_vs_bytes.png")))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)
  return paths


def write(report: dict, out: pathlib.Path) -> None:
  """``compare.{json,md}`` and the plots; ``compare_fsdp.*`` for the FSDP layout."""
  out.mkdir(parents=True, exist_ok=True)
  stem = "compare_fsdp" if report["config"].get("layout") == "fsdp" else "compare"
  (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
  (out / f"{stem}.md").write_text(markdown(report))
  if report["methods"]:
    plot(report, out)


# ------------------------------------------------------ the large-batch recipe

# `--large-batch`: the 2D-torus paper's (Mikami et al., arXiv:1811.05233)
# recipe for large mini-batches, batch-size control and label smoothing, on
# digits. Every run draws the examples of the main job's run (its steps at
# 32 per device on 8 devices, 256 examples a step), so they differ only in
# how those examples are batched and in the labels. 1,024 is "large" here:
# 71% of the 1,437 training examples in every step. The learning rate follows
# one rule in every run, chosen before any run: the main job's schedule (its
# peak 0.1 tuned at 256 examples, linear warm-up over 5% of the run's steps,
# cosine decay to 0 at its last step) times the batch of the step over 256
# (Goyal et al.'s linear scaling rule, `training.batch_scaled_learning_rate`).
# The batch-size control stages and the smoothing (0.1, the usual value) were
# set before any run too, and not tuned. One more run trains the large batch
# at the rate tuned for 256, not scaled: the large batch's best chance
# without the recipe (the scaled rate makes it collapse; see large_batch.md).
LARGE_BATCH = {
    "base_batch": 256,
    "large_batch": 1024,
    # Batch-size control: (global batch, share of the run's examples drawn at it).
    "stages": ((256, 0.25), (512, 0.25), (1024, 0.5)),
    "label_smoothing": 0.1,
    "methods": ("allreduce", "gtopk", "powersgd"),
    "repeats": 3,
}
# run -> (batches: "small", "large" or "control"; label smoothing on; the
# learning rate scaled with the batch)
LARGE_BATCH_RUNS = {
    "small batch (reference)": ("small", False, True),
    "large batch": ("large", False, True),
    "large batch, rate not scaled": ("large", False, False),
    "large + batch-size control": ("control", False, True),
    "large + label smoothing": ("large", True, True),
    "large + both (the recipe)": ("control", True, True),
}


CHANCE_ACCURACY = 0.2


def _large_steps(mode: str) -> int:
  """Steps at the large batch that draw the main job's examples (its steps at 256)."""
  return TASKS["digits"][f"{mode}_steps"] * LARGE_BATCH["base_batch"] // LARGE_BATCH["large_batch"]


def large_batch_schedules(large_steps: int) -> dict[str, tuple[training.BatchSizeSchedule, int]]:
  """``{"small" | "large" | "control": (batch sizes, steps)}`` drawing ``large_steps`` large batches' examples."""
  small, large = LARGE_BATCH["base_batch"], LARGE_BATCH["large_batch"]
  examples = large_steps * large
  boundaries, start = {}, 0
  for size, share in LARGE_BATCH["stages"]:
    boundaries[start] = size
    start += max(1, round(share * examples / size))
  return {
      "small": (training.batch_size_schedule({0: small}), examples // small),
      "large": (training.batch_size_schedule({0: large}), large_steps),
      "control": (training.batch_size_schedule(boundaries), start),
  }


def scheduled_image_batches(split: data.Split, sizes: training.BatchSizeSchedule, seed: int):
  """``(x, y)`` batches of ``sizes(step)`` examples, as :func:`experiments.data.image_batches` draws them.

  Without replacement, reshuffled when what is left of the epoch is smaller
  than the next batch: a constant schedule gives ``image_batches``' batches.
  """
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(split))
  position = 0
  step = 0
  while True:
    size = sizes(step)
    if size > len(split):
      raise ValueError(f"a batch of {size} is larger than the {len(split)} training examples")
    if position + size > len(order):
      order = rng.permutation(len(split))
      position = 0
    chosen = order[position:position + size]
    position += size
    step += 1
    yield split.x[chosen], split.y[chosen]


def _smoothed_digits_loss(smoothing: float):
  """The digits CNN's loss against labels smoothed by ``smoothing`` (``optax.smooth_labels``)."""
  from flax import nnx

  graphdef, _ = nnx.split(models.DigitsCNN(10, nnx.Rngs(0)))

  def loss(params, batch):
    x, y = batch
    logits = nnx.merge(graphdef, params)(x)
    targets = optax.smooth_labels(jax.nn.one_hot(y, logits.shape[-1]), smoothing)
    return optax.softmax_cross_entropy(logits, targets).mean()

  return loss


def _large_batch_run(name: str, run: str, config: Config, task: dict, dataset, mesh,
                     schedules: dict, evaluate) -> dict:
  """One method in one run of :data:`LARGE_BATCH_RUNS`, over ``config.repeats`` seeds."""
  kind, smoothed, scaled = LARGE_BATCH_RUNS[run]
  sizes, steps = schedules[kind]
  smoothing = LARGE_BATCH["label_smoothing"] if smoothed else 0.0
  run_config = dataclasses.replace(config, steps=steps, eval_every=min(config.eval_every, steps))
  method = task["methods"][name]
  compressor_config = _compressor_config(method, steps)
  learning_rate = _schedule(task, steps)
  if scaled:
    learning_rate = training.batch_scaled_learning_rate(
        learning_rate, sizes, LARGE_BATCH["base_batch"])
  _, tx = _chain(name, config.axis_name, compressor_config, method["momentum"], learning_rate)
  loss = _smoothed_digits_loss(smoothing) if smoothed else models.digits_cnn(config.seed).loss
  step = training.make_step(loss, tx, mesh, config.axis_name)
  compiled = None  # one compile per batch size, shared by the seeds
  seeds = []
  for seed in range(config.seed, config.seed + config.repeats):
    started = time.perf_counter()
    params = training.replicate(models.digits_cnn(seed).params, mesh)
    opt_state = training.init_state(tx, params, mesh, config.axis_name)
    batches = scheduled_image_batches(dataset.train, sizes, seed)
    first = training.shard(next(batches), mesh, config.axis_name)
    if compiled is None:
      compiled = training.compile_batch_sizes(
          step, params, opt_state, first, sizes, mesh, config.axis_name)
    history, times, skipped = _train_loop(
        f"{name}, {run}, seed {seed}", run_config,
        lambda p, s, batch: compiled[batch[1].shape[0]](p, s, batch),
        params, opt_state, first,
        lambda: training.shard(next(batches), mesh, config.axis_name), evaluate)
    seeds.append({
        "seed": seed,
        "final_accuracy": history[-1]["eval_accuracy"],
        "final_loss": history[-1]["eval_loss"],
        "skipped_steps": skipped,
        "wall_time_s": time.perf_counter() - started,
        "history": history,
    })
  accuracies = [r["final_accuracy"] for r in seeds]
  return {
      "batch_sizes": dict(zip(sizes.boundaries, sizes.sizes)),
      "steps": steps,
      "examples": sizes.examples(steps),
      "label_smoothing": smoothing,
      "learning_rate_scaled": scaled,
      "peak_learning_rate": task["peak_lr"] * (
          max(sizes.sizes) / LARGE_BATCH["base_batch"] if scaled else 1),
      "compiles": len(compiled),
      "accuracy_mean": statistics.mean(accuracies),
      "accuracy_sd": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
      "configuration": _describe(name, compressor_config, method["momentum"]),
      "seeds": seeds,
  }


def run_large_batch(config: Config) -> dict:
  """Every method of ``config`` in every run of :data:`LARGE_BATCH_RUNS`; writes ``large_batch.{md,json}``."""
  ensure_devices(config.devices)
  clock = _RunClock()
  task = TASKS["digits"]
  dataset = data.digits(config.evaluate_on)
  model = models.digits_cnn(config.seed)
  if config.mesh is None:
    mesh = training.make_mesh(config.devices)
  else:
    mesh = training.make_mesh(config.mesh, config.axis_name)
  schedules = large_batch_schedules(config.steps)
  for sizes, _ in schedules.values():
    training.check_batch_sizes(sizes, mesh, config.axis_name)
  eval_x, eval_y = _eval_arrays("digits", task, dataset)
  jitted = jax.jit(model.evaluate)
  evaluate = lambda params: jitted(params, eval_x, eval_y)
  methods = {}
  for name in config.methods:
    compressor = registry.build(name, config.axis_name,
                                **_compressor_config(task["methods"][name], config.steps))
    methods[name] = {
        "bytes_per_step_formula": float(wire.expected_bytes(
            compressor, model.params, config.num_devices).total),
        "runs": {run: _large_batch_run(name, run, config, task, dataset, mesh, schedules,
                                       evaluate) for run in LARGE_BATCH_RUNS},
    }
  report = {
      "config": {
          "task": "digits",
          "mode": config.mode,
          "model": model.description,
          "num_params": models.num_params(model.params),
          "devices": config.devices,
          "mesh": list(config.mesh) if config.mesh else None,
          "large_steps": config.steps,
          "repeats": config.repeats,
          "seeds": list(range(config.seed, config.seed + config.repeats)),
          **{k: v for k, v in LARGE_BATCH.items() if k != "methods"},
          "learning_rate": (
              f"({task['peak_lr']} x global batch / {LARGE_BATCH['base_batch']}) x (linear"
              f" warm-up over {task['warmup_fraction']:.0%} of the run's steps, cosine decay"
              " to 0 at its last step)"),
          "evaluated_on": dataset.eval_name,
          "train_examples": len(dataset.train),
          "eval_examples": len(dataset.eval),
          **clock.record(),
      },
      "methods": methods,
  }
  out = pathlib.Path(config.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "large_batch.json").write_text(json.dumps(report, indent=1) + "\n")
  (out / "large_batch.md").write_text(markdown_large_batch(report))
  return report


def large_batch_verdict(recipe: dict, large: dict, repeats: int) -> str:
  """Whether the recipe's mean accuracy beats the large batch's by more than seed noise.

  "helps" / "hurts" when the difference of the means is more than twice its
  standard error over the seeds, ``sqrt((sd_a^2 + sd_b^2) / repeats)``.
  """
  delta = recipe["accuracy_mean"] - large["accuracy_mean"]
  if repeats < 2:
    return f"{100 * delta:+.1f} pt, one seed: no spread to judge it by"
  error = math.sqrt((recipe["accuracy_sd"] ** 2 + large["accuracy_sd"] ** 2) / repeats)
  word = ("helps" if delta > 2 * error else "hurts" if delta < -2 * error
          else "no difference beyond seed noise")
  return f"{100 * delta:+.1f} pt (standard error {100 * error:.1f} pt): {word}"


def markdown_large_batch(report: dict) -> str:
  """``large_batch.md``: every method's runs, mean accuracy over the seeds, the verdict."""
  config, methods = report["config"], report["methods"]
  repeats = config["repeats"]
  stages = " -> ".join(str(b) for b, _ in config["stages"])
  lines = [
      f"# Large-batch recipe: digits ({config['mode']})",
      "",
      f"{config['model']}, {config['num_params']:,} parameters, on {config['devices']} fake"
      f" CPU devices; {config['train_examples']:,} training examples. Every run draws the"
      f" same number of examples ({config['large_steps']} steps of {config['large_batch']}),"
      f" without replacement within an epoch. Learning rate: {config['learning_rate']}, the"
      " same rule in every run but the one marked \"rate not scaled\" (the same schedule"
      " without the factor). Batch-size control: the global batch grows"
      f" {stages} over {', '.join(f'{s:.0%}' for _, s in config['stages'])} of the examples;"
      f" label smoothing {config['label_smoothing']} (`optax.smooth_labels`)."
      f" Evaluated on the {config['evaluated_on']} split ({config['eval_examples']} examples,"
      f" one example = {100 / config['eval_examples']:.2f} pt) with the plain cross-entropy;"
      f" mean and standard deviation over seeds {config['seeds']} (initialisation and batch"
      " order). Wall time:"
      f" {config['wall_time_s']:.0f} s on {config['cpu_count']} cores (1-minute load average"
      f" {config['load_average_1min'][0]:.1f} at the start).",
      "",
      f"| method | run | global batch (from step: size) | steps | peak rate | label smoothing"
      f" | {config['evaluated_on']} accuracy | per seed | at chance | vs large batch |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  verdicts = []
  for name, row in methods.items():
    runs = row["runs"]
    large = runs["large batch"]
    for run, r in runs.items():
      sizes = ", ".join(f"{s}: {b}" for s, b in r["batch_sizes"].items())
      per_seed = ", ".join(f"{s['final_accuracy']:.4f}" for s in r["seeds"])
      delta = 100 * (r["accuracy_mean"] - large["accuracy_mean"])
      chance = sum(s["final_accuracy"] < CHANCE_ACCURACY for s in r["seeds"])
      lines.append(
          f"| {name} | {run} | {sizes} | {r['steps']} | {r['peak_learning_rate']:g}"
          f" | {r['label_smoothing']:g}"
          f" | {r['accuracy_mean']:.4f} ± {r['accuracy_sd']:.4f} | {per_seed}"
          f" | {chance} of {len(r['seeds'])} | {'-' if run == 'large batch' else f'{delta:+.1f} pt'} |")
    unscaled = large_batch_verdict(
        runs["large + both (the recipe)"], runs["large batch, rate not scaled"], repeats)
    verdicts.append(
        f"- **{name}** ({row['bytes_per_step_formula']:,.0f} bytes per device per step):"
        f" the large batch against the small one"
        f" {large_batch_verdict(large, runs['small batch (reference)'], repeats)};"
        f" the recipe against the large batch"
        f" {large_batch_verdict(runs['large + both (the recipe)'], large, repeats)},"
        f" against the large batch at the rate not scaled {unscaled}.")
  lines += [
      "",
      "Does the recipe help? A difference of means counts when it is more than twice its"
      " standard error over the seeds:",
      "",
      *verdicts,
      "",
      "Batch-size control draws the same examples in more steps (its early batches are"
      " smaller: the **steps** column), and more updates are part of what it does. The"
      " scaled rate (Goyal et al.'s linear rule, with its warm-up) was fixed before any run;"
      " \"rate not scaled\" gives the large batch a second chance without the recipe, at"
      " the rate tuned for the small batch (untuned as well).",
      "",
      f"**at chance**: seeds that ended below {CHANCE_ACCURACY:.0%} test accuracy (10 classes:"
      " 10% is a constant guess; their test loss is ln 10 = 2.303, the network collapsed"
      " to a constant output and never recovered).",
      "",
      "Each global batch size is one compile of the step (`training.compile_batch_sizes`),"
      " shared by the seeds.",
  ]
  return "\n".join(lines) + "\n"


# --------------------------------------------------------------------- CLI


def _methods(text: str) -> tuple[str, ...]:
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  unknown = [n for n in names if n not in ALL_METHODS]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"methods must be a comma-separated list of {', '.join(ALL_METHODS)}; got {text!r}"
    )
  return names


def _mesh(text: str) -> tuple[int, int]:
  try:
    rows, cols = (int(v) for v in text.lower().split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--mesh must be ROWSxCOLS, e.g. 2x4; got {text!r}") from None
  if rows < 1 or cols < 1:
    raise argparse.ArgumentTypeError(f"--mesh sizes must be >= 1; got {text!r}")
  return rows, cols


def positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m experiments.compare",
      description=(
          "Train the same model with every jaxcomp compressor, data-parallel on fake"
          " CPU devices, and write compare.json, compare.md and plots."
      ),
  )
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_true",
                    help="the default: digits {} steps, text {} (<= 5 min on 2 cores for"
                    " digits)".format(*(TASKS[t]["quick_steps"] for t in ("digits", "text"))))
  mode.add_argument("--full", action="store_true",
                    help="longer runs: digits {} steps, text {}".format(
                        *(TASKS[t]["full_steps"] for t in ("digits", "text"))))
  p.add_argument("--task", choices=sorted(TASKS) + ["lm"], default="digits",
                 help="digits: a CNN on scikit-learn's digits (default); text: a"
                 " char-level transformer on Python standard-library sources; lm: a"
                 " byte-level language model, synchronous against DiLoCo, dense and"
                 " compressed (its own options: --task lm --help)")
  p.add_argument("--methods", type=_methods,
                 help=f"comma-separated subset of {','.join(ALL_METHODS)} (default: all;"
                 f" with --large-batch {','.join(LARGE_BATCH['methods'])})")
  p.add_argument("--steps", type=positive, help="training steps (overrides --quick/--full)")
  p.add_argument("--devices", type=positive, default=8,
                 help="fake CPU devices on one data axis (default 8)")
  p.add_argument("--mesh", type=_mesh,
                 help="ROWSxCOLS: a 2D mesh of axes (x, y), the dense all-reduces as the"
                 " 2D torus (sets --devices to ROWS*COLS)")
  p.add_argument("--layout", choices=("replicated", "fsdp"), default="replicated",
                 help="replicated: parameters on every device, each compressor over every"
                 " data axis (default); fsdp (needs --mesh): parameters sharded over the"
                 " mesh's second axis (the fast one, inside a node), each compressor over"
                 " its first axis (the slow one, between nodes) on the shard, results in"
                 " compare_fsdp.*")
  p.add_argument("--out", default=str(RESULTS_DIR),
                 help="output directory (default experiments/results)")
  p.add_argument("--eval-every", type=positive, help="steps between evaluations (default 50)")
  p.add_argument("--evaluate-on", choices=("test", "validation"), default="test",
                 help="validation trains on the training split less a fixed fifth and"
                 " reports on that fifth: use it to tune, never the test split")
  p.add_argument("--bandwidth-gbit", type=float, default=1.0,
                 help="link bandwidth of the cost model's prediction (default 1 Gbit/s)")
  p.add_argument("--latency-us", type=float, default=50.0,
                 help="per-message latency of the cost model's prediction (default 50 us)")
  p.add_argument("--seed", type=int, default=0, help="initialisation and batch order (default 0)")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--large-batch", action="store_true",
                 help="digits at a global batch of {large_batch} (4x the main job's) on the"
                 " main job's number of examples, with and without the 2D-torus paper's"
                 " recipe (batch-size control {control}, label smoothing {label_smoothing}),"
                 " each part alone too, against the batch of {base_batch}; writes"
                 " large_batch.md and .json. --steps sets the steps at the large batch"
                 " (default {quick} quick, {full} full)".format(
                     **LARGE_BATCH, control=" -> ".join(str(b) for b, _ in LARGE_BATCH["stages"]),
                     quick=_large_steps("quick"), full=_large_steps("full")))
  p.add_argument("--repeats", type=positive,
                 help="--large-batch only: seeds per run, --seed, --seed + 1, ..."
                 f" (default {LARGE_BATCH['repeats']})")
  return p


def config_from_args(argv=None) -> Config:
  p = parser()
  args = p.parse_args(argv)
  if args.large_batch and (args.task != "digits" or args.layout == "fsdp"):
    p.error("--large-batch trains digits in the replicated layout")
  if args.repeats and not args.large_batch:
    p.error("--repeats is for --large-batch")
  if args.layout == "fsdp" and args.mesh is None:
    p.error("--layout fsdp needs a 2-axis mesh, e.g. --mesh 2x4: the parameters are"
            " sharded over its second (fast) axis and each compressor runs over its first"
            " (slow) axis")
  task = TASKS[args.task]
  mode = "full" if args.full else "quick"
  steps = args.steps or (_large_steps(mode) if args.large_batch else task[f"{mode}_steps"])
  if args.steps:
    mode = f"{args.steps} steps"
  devices = args.mesh[0] * args.mesh[1] if args.mesh else args.devices
  methods = args.methods or (LARGE_BATCH["methods"] if args.large_batch else ALL_METHODS)
  return Config(
      task=args.task, methods=methods, steps=steps, devices=devices, mesh=args.mesh,
      eval_every=min(args.eval_every or task["eval_every"], steps),
      evaluate_on=args.evaluate_on, bandwidth_gbit=args.bandwidth_gbit,
      latency_us=args.latency_us, seed=args.seed, out=args.out,
      progress=not args.no_progress, mode=mode, layout=args.layout,
      large_batch=args.large_batch,
      repeats=(args.repeats or LARGE_BATCH["repeats"]) if args.large_batch else 1,
  )


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  first = argparse.ArgumentParser(add_help=False)
  first.add_argument("--task")
  if first.parse_known_args(argv)[0].task == "lm":  # the language model's job has its own options
    from experiments import lm

    lm.main(argv)
    return
  config = config_from_args(argv)
  if config.large_batch:
    print(markdown_large_batch(run_large_batch(config)))
    return
  report = run(config)
  print(markdown(report))


if __name__ == "__main__":
  main()
