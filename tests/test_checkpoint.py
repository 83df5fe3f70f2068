"""Checkpoints restored onto another number of devices, for every registered method.

Every method runs in the replicated layout (:func:`jaxcomp.training.make_step`
on a ring of axis ``data``) and in the FSDP one
(:func:`jaxcomp.training.make_fsdp_step` on ``("dcn", "ici")``, the compressor
on ``dcn``, 4 devices along ``ici``). Trained on 8 devices and saved, every
case of a layout is restored in one fresh process of 4 fake devices (ring 8
-> 4, FSDP 2x4 -> 1x4), trained on and saved again; this process restores
that onto 8 devices (4 -> 8). Each restore must:

* carry bit for bit a state leaf equal on every device (on every device of
  each ``ici`` position under FSDP, whose shards differ along ``ici``);
* keep any other leaf's mean over those devices to float32 rounding: every
  payload is divided by the device count before the sum, so that mean is
  the update the residuals (and DGC's local momenta) still owe;
* carry the parameters and the step, and train on: finite, replicas
  identical, counts advanced.

Run as a script (``python tests/test_checkpoint.py restore DIRECTORY LAYOUT``)
this module is that fresh process.
"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys
import traceback
from typing import Callable

import jax

if __name__ == "__main__":  # the fresh process: 4 devices
  jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402

import harness  # noqa: E402
import jaxcomp  # noqa: E402
from jaxcomp import registry  # noqa: E402
from jaxcomp import training  # noqa: E402
from jaxcomp._src import checkpoint as checkpoint_lib  # noqa: E402

LAYOUTS = ("replicated", "fsdp")
SLOW, FAST, FAST_SIZE = "dcn", "ici", 4
SAVED_STEPS, MORE_STEPS = 3, 2
GLOBAL_BATCH = 48  # split evenly over 8, 4 and 3 devices
# Enough for a 10 x 6 model to send something and keep a residual; QSGD with
# error feedback and DGC with its momentum, clipping and warm-up, so that every
# method holds per-device state.
CONFIG = {"density": 0.3, "rank": 1, "levels": 8}
EXTRA = {"randomk": {"seed": 1}, "qsgd": {"error_feedback": True},
         "dgc": {"momentum": 0.9, "clip_norm": 1.0, "warmup_steps": 4}}


def _compressor(name: str, axis) -> optax.GradientTransformation:
  config = {k: v for k, v in CONFIG.items() if k in registry.get(name).defaults}
  return registry.build(name, axis, **{**config, **EXTRA.get(name, {})})


def _params():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(10, 6)).astype(np.float32),
          "b": np.zeros(6, np.float32)}


def _loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _batch(step: int):
  """Step ``step``'s global batch, the same whatever the device count."""
  rng = np.random.default_rng(100 + step)
  return {"x": rng.normal(size=(GLOBAL_BATCH, 10)).astype(np.float32),
          "y": rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32)}


class _Setup:
  """One chain in one layout on ``devices`` devices: mesh, step, state and what to read.

  Layouts: ``replicated`` (a ring of axis ``data``), ``fsdp`` (parameters in
  row blocks over ``ici``, the compressor on ``dcn``) and ``hierarchical``
  (replicated parameters, ``jaxcomp.hierarchical`` of the compressor on
  ``dcn``), the last two on ``(devices / 4, 4)`` devices.
  """

  def __init__(self, compressor, optimizer, layout: str, devices: int):
    """``compressor(axis)``: the compressor over ``axis``; ``optimizer`` follows it."""
    self.fsdp = layout == "fsdp"
    self.devices = devices
    params = _params()
    if layout == "replicated":
      self.mesh, self.axis, self.columns = training.make_mesh(devices), "data", 1
      self.tx = optax.chain(compressor("data"), optimizer)
    else:
      self.mesh = training.make_mesh((devices // FAST_SIZE, FAST_SIZE), (SLOW, FAST))
      self.axis = (SLOW, FAST)
      self.columns = FAST_SIZE  # device (s, f) is row s of column f, holding shard f
      inner = compressor(SLOW)
      self.tx = optax.chain(
          inner if self.fsdp else jaxcomp.hierarchical(inner, FAST, FAST_SIZE), optimizer)
    if self.fsdp:
      self.step = training.make_fsdp_step(_loss, self.tx, self.mesh, SLOW, FAST, params)
      self.like = jax.eval_shape(self.tx.init, training.shard_shapes(params, FAST_SIZE))
    else:
      self.step = training.make_step(_loss, self.tx, self.mesh, self.axis)
      self.like = jax.eval_shape(self.tx.init, params)
    self.paths = [jax.tree_util.keystr(p)
                  for p, _ in jax.tree_util.tree_leaves_with_path(self.like)]

  def fresh(self):
    params = _params()
    if self.fsdp:
      return (training.shard_params(params, self.mesh, FAST),
              training.init_fsdp_state(self.tx, params, self.mesh, SLOW, FAST))
    return (training.replicate(params, self.mesh),
            training.init_state(self.tx, params, self.mesh, self.axis))

  def restore(self, directory):
    params, state = self.fresh()
    return training.restore_checkpoint(
        directory, params, state, self.mesh, self.axis,
        params_spec=PartitionSpec(FAST if self.fsdp else None))

  def train(self, params, state, first: int, last: int):
    """Steps ``first`` to ``last - 1``; also every step's ``finite`` flags, ``[steps, devices]``."""
    finite = []
    for step in range(first, last):
      batch = training.shard(_batch(step), self.mesh, self.axis)
      # Blocked on every step: queued steps make XLA:CPU abort its collectives.
      params, state, metrics = jax.block_until_ready(self.step(params, state, batch))
      finite.append(np.asarray(metrics["finite"]))
    return params, state, np.array(finite, bool).reshape(-1, self.devices)

  def record(self, params, state, step: int) -> dict[str, np.ndarray]:
    """What the checks read, as numpy: each state leaf's device rows, the parameters
    whole and each device's copy of them."""
    out = {"step": np.array(step)}
    for i, rows in enumerate(jax.tree.leaves(training.device_rows(state, self.like))):
      out[f"state{i}"] = np.asarray(rows)
    for i, x in enumerate(jax.tree.leaves(params)):
      out[f"param{i}"] = np.asarray(x)
      shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
      out[f"copies{i}"] = np.stack([np.asarray(s.data) for s in shards])
      out[f"index{i}"] = np.array([str(s.index) for s in shards])
    return out


def _method(name: str) -> tuple[Callable[..., optax.GradientTransformation],
                                optax.GradientTransformation]:
  """``(compressor(axis), optimizer)``: adamw, or plain SGD after DGC.

  adamw's moments are state equal on every device, besides the compressor's
  count, keys and factors.
  """
  carries_momentum = bool(registry.get(name).forbids_after)
  return (lambda axis: _compressor(name, axis),
          optax.sgd(0.05) if carries_momentum else optax.adamw(1e-2))


def _bits(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x).view(np.uint8)


def _by_column(rows: np.ndarray, columns: int) -> np.ndarray:
  """Device rows ``[devices, ...]`` as ``[devices / columns, columns, n]`` (row-major devices)."""
  return rows.reshape(rows.shape[0] // columns, columns, -1)


def _check_restored(saved: dict, restored: dict, setup: _Setup) -> int:
  """Asserts what a restore onto another device count keeps; returns how many
  state leaves were redistributed (not equal on every device of a column)."""
  assert int(restored["step"]) == int(saved["step"])
  for key in (k for k in saved if k.startswith("param")):
    np.testing.assert_array_equal(_bits(restored[key]), _bits(saved[key]), err_msg=key)
  redistributed = 0
  for i, path in enumerate(setup.paths):
    old = _by_column(saved[f"state{i}"], setup.columns)
    new = _by_column(restored[f"state{i}"], setup.columns)
    assert old.dtype == new.dtype and old.shape[1:] == new.shape[1:], path
    if (_bits(old) == _bits(old[:1])).all():
      np.testing.assert_array_equal(
          _bits(new), _bits(np.broadcast_to(old[:1], new.shape)),
          err_msg=f"{path} is equal on every device and must be carried bit for bit")
      continue
    redistributed += 1
    # Each new row is rounded once to f32: within half an ulp of its exact value.
    tolerance = np.finfo(old.dtype).eps * np.abs(old).max()
    np.testing.assert_allclose(
        new.astype(np.float64).mean(axis=0), old.astype(np.float64).mean(axis=0),
        rtol=0, atol=tolerance, err_msg=f"{path}: the mean over devices is not kept")
  return redistributed


def _check_trained(before: dict, after: dict, finite: np.ndarray, setup: _Setup) -> None:
  """Asserts that steps after a restore trained: finite, replicas identical, counts advanced."""
  assert finite.all(), finite
  for key in (k for k in after if k.startswith("copies")):
    copies, index = after[key], list(after[key.replace("copies", "index")])
    for copy, at in zip(copies, index):  # the devices holding the same block agree
      np.testing.assert_array_equal(_bits(copy), _bits(copies[index.index(at)]), err_msg=key)
  for key in (k for k in after if k.startswith("state")):
    if np.issubdtype(after[key].dtype, np.floating):
      assert np.isfinite(after[key]).all(), key
  steps = len(finite)
  counts = [i for i, path in enumerate(setup.paths) if path.endswith(".count")]
  assert counts or not setup.paths
  for i in counts:
    np.testing.assert_array_equal(after[f"state{i}"], before[f"state{i}"] + steps,
                                  err_msg=setup.paths[i])


# ------------------------------------------------------ the fresh process


def _restore_every_method(directory: pathlib.Path, layout: str) -> None:
  """The 4-device process: each method's checkpoint restored, trained on and saved.

  Writes ``restored.npz``, ``trained.npz`` and the checkpoint ``trained``
  in each method's directory, or ``error.txt`` with its traceback, so that
  one method's failure leaves the others' results.
  """
  for name in registry.names():
    case = directory / name
    try:
      setup = _Setup(*_method(name), layout, 4)
      params, state, step = setup.restore(case / "saved")
      np.savez(case / "restored.npz", **setup.record(params, state, step))
      params, state, finite = setup.train(params, state, step, step + MORE_STEPS)
      np.savez(case / "trained.npz", finite=finite,
               **setup.record(params, state, step + MORE_STEPS))
      training.save_checkpoint(case / "trained", params, state, step + MORE_STEPS)
    except Exception:  # pylint: disable=broad-except
      (case / "error.txt").write_text(traceback.format_exc())


# ----------------------------------------------------------- the tests


@functools.lru_cache(maxsize=None)
def _saved_on_8(layout: str, directory: pathlib.Path):
  """Every method trained ``SAVED_STEPS`` on 8 devices and saved in ``directory / name / "saved"``.

  Returns ``{name: (setup, record)}``: the setup, whose compiled step the
  restores back onto 8 devices reuse, and what was saved.
  """
  runs = {}
  for name in registry.names():
    setup = _Setup(*_method(name), layout, 8)
    params, state = setup.fresh()
    params, state, _ = setup.train(params, state, 0, SAVED_STEPS)
    training.save_checkpoint(directory / name / "saved", params, state, SAVED_STEPS)
    runs[name] = (setup, setup.record(params, state, SAVED_STEPS))
  return runs


@pytest.fixture(scope="module")
def saved_on_8(tmp_path_factory):
  """``saved_on_8(layout)``: the directory of every method's checkpoint and :func:`_saved_on_8`."""
  directories = {layout: tmp_path_factory.mktemp(layout) for layout in LAYOUTS}
  return lambda layout: (directories[layout], _saved_on_8(layout, directories[layout]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_method_restores_onto_4_devices_and_back_onto_8(layout, saved_on_8):
  """One fresh 4-device process restores every method of the layout (8 -> 4);
  this process restores what it saved (4 -> 8). Every method is checked, and
  every one that fails is named."""
  directory, runs = saved_on_8(layout)
  done = subprocess.run(
      [sys.executable, __file__, "restore", str(directory), layout],
      capture_output=True, text=True, timeout=600,
      env=harness.fresh_process_env())
  assert done.returncode == 0, done.stdout + done.stderr

  failures = {}
  for name in registry.names():
    case = directory / name
    setup8, saved = runs[name]
    try:
      assert not (case / "error.txt").exists(), (case / "error.txt").read_text()
      setup4 = _Setup(*_method(name), layout, 4)  # for its paths and columns only
      with np.load(case / "restored.npz") as restored, np.load(case / "trained.npz") as trained:
        restored, trained = dict(restored), dict(trained)
      moved = _check_restored(saved, restored, setup4)
      # Every method keeps a per-device residual here, or DGC's momentum.
      assert moved or registry.get(name).state is optax.EmptyState, "nothing redistributed"
      _check_trained(restored, trained, trained.pop("finite"), setup4)

      params, state, step = setup8.restore(case / "trained")
      back = setup8.record(params, state, step)
      _check_restored(trained, back, setup8)
      params, state, finite = setup8.train(params, state, step, step + MORE_STEPS)
      _check_trained(back, setup8.record(params, state, step + MORE_STEPS), finite, setup8)
    except AssertionError as e:
      failures[name] = str(e)
  assert not failures, "\n\n".join(f"{name}: {message}" for name, message in failures.items())


@pytest.mark.parametrize("name", registry.names())
def test_ring_of_8_restores_onto_a_2x4_torus_bit_for_bit(name, saved_on_8):
  """Same device count: each device's block goes to the device of the same
  row-major position, bit for bit, and the torus step trains on it."""
  directory, runs = saved_on_8("replicated")
  ring, saved = runs[name]
  compressor, optimizer = _method(name)
  mesh, axes = training.make_mesh((2, 4), ("x", "y")), ("x", "y")
  tx = optax.chain(compressor(axes), optimizer)
  like = _params()
  params, state, step = training.restore_checkpoint(
      directory / name / "saved", training.replicate(like, mesh),
      training.init_state(tx, like, mesh, axes), mesh, axes)
  restored = ring.record(params, state, step)
  for key in saved:
    if not key.startswith("index"):  # the torus names its shards' indices alike
      np.testing.assert_array_equal(_bits(restored[key]), _bits(saved[key]), err_msg=key)
  torus_step = training.make_step(_loss, tx, mesh, axes)
  params, state, metrics = jax.block_until_ready(
      torus_step(params, state, training.shard(_batch(step), mesh, axes)))
  assert np.asarray(metrics["finite"]).all()
  training.check_replicas(params)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((params, state)))


# Random-k's update is linear in the corrected gradients' mean: every device sends
# the same coordinates (the shared key), where the update is mean(g) + mean(residual).
# Restored onto another device count, the first step on the same global batch is
# the uninterrupted run's only if the residuals' mean is kept (a kept sum would
# double it from 8 devices to 4); under FSDP and the hierarchy only if it is kept
# for each shard (devices of the same ici position).
PREDICTED = {
    "ring 8 -> 4": ("replicated", 4),
    "ring 8 -> 3": ("replicated", 3),
    "fsdp 2x4 -> 1x4": ("fsdp", 4),
    "hierarchical 2x4 -> 1x4": ("hierarchical", 4),
}
LEARNING_RATE = 0.1


def _randomk(layout: str, devices: int) -> _Setup:
  return _Setup(lambda axis: jaxcomp.randomk(0.3, axis, seed=1), optax.sgd(LEARNING_RATE),
                layout, devices)


@pytest.mark.parametrize("case", PREDICTED)
def test_first_step_after_a_restore_applies_the_residuals_mean(case, tmp_path):
  layout, devices = PREDICTED[case]
  old = _randomk(layout, 8)
  params, state = old.fresh()
  params, state, _ = old.train(params, state, 0, SAVED_STEPS)
  training.save_checkpoint(tmp_path / "saved", params, state, SAVED_STEPS)
  want, _, _ = old.train(params, state, SAVED_STEPS, SAVED_STEPS + 1)
  want = [np.asarray(x) for x in jax.tree.leaves(want)]

  new = _randomk(layout, devices)
  params, state, step = new.restore(tmp_path / "saved")
  got, _, finite = new.train(params, state, step, step + 1)
  assert finite.all()
  tolerance = 2e-6
  for g, w in zip(jax.tree.leaves(got), want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=tolerance)

  # Not vacuous: without the residuals the step lands far outside the tolerance.
  params, state, step = new.restore(tmp_path / "saved")
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: x * 0 if "residual" in jax.tree_util.keystr(path) else x, state)
  free, _, _ = new.train(params, state, step, step + 1)
  assert max(np.abs(np.asarray(f) - w).max() for f, w in zip(jax.tree.leaves(free), want)) > (
      100 * tolerance)


def test_fsdp_onto_another_fast_axis_size_names_both_sizes(tmp_path):
  old = _Setup(*_method("topk"), "fsdp", 8)
  params, state = old.fresh()
  training.save_checkpoint(tmp_path / "saved", params, state, 0)
  mesh = training.make_mesh((4, 2), (SLOW, FAST))
  compressor, optimizer = _method("topk")
  tx = optax.chain(compressor(SLOW), optimizer)
  like = _params()
  with pytest.raises(ValueError, match=r"fast axis of 4 devices, but `mesh` has 2 along 'ici'"):
    training.restore_checkpoint(
        tmp_path / "saved", training.shard_params(like, mesh, FAST),
        training.init_fsdp_state(tx, like, mesh, SLOW, FAST), mesh, (SLOW, FAST),
        params_spec=PartitionSpec(FAST))


def test_hierarchical_onto_another_fast_axis_size_names_the_leaf(tmp_path):
  old = _randomk("hierarchical", 8)
  params, state = old.fresh()
  training.save_checkpoint(tmp_path / "saved", params, state, 0)
  mesh = training.make_mesh((4, 2), (SLOW, FAST))
  tx = optax.chain(jaxcomp.hierarchical(jaxcomp.randomk(0.3, SLOW, seed=1), FAST, 2),
                   optax.sgd(LEARNING_RATE))
  like = _params()
  with pytest.raises(ValueError, match=r"state leaf .*residual with one device's block"
                                       r" of shape \[20\], but `opt_state` has \[33\]"):
    training.restore_checkpoint(tmp_path / "saved", training.replicate(like, mesh),
                                training.init_state(tx, like, mesh, (SLOW, FAST)), mesh,
                                (SLOW, FAST))


def test_a_checkpoint_without_axis_sizes_restores_onto_its_own_count_only(tmp_path):
  """A checkpoint written before the state's axes were recorded holds its device count only."""
  setup = _Setup(*_method("topk"), "replicated", 8)
  params, state = setup.fresh()
  params, state, _ = setup.train(params, state, 0, SAVED_STEPS)
  want = setup.record(params, state, SAVED_STEPS)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(
      tmp_path / "old", {"params": params, "opt_state": state, "step": SAVED_STEPS},
      custom_metadata={"jaxcomp_num_replicas": 8,
                       "jaxcomp_param_shapes": checkpoint_lib._param_shapes(params)})
  checkpointer.wait_until_finished()
  got = setup.record(*setup.restore(tmp_path / "old"))
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  small = _Setup(*_method("topk"), "replicated", 4)
  with pytest.raises(ValueError, match=r"state for 8 devices, but the mesh has 4 devices.*"
                                       r"without the state's axis sizes"):
    small.restore(tmp_path / "old")


def test_redistribution_keeps_the_mean_and_carries_equal_rows():
  """The map alone, on counts a mesh test does not reach (5 -> 3, 3 -> 7, ...)."""
  rng = np.random.default_rng(0)
  for old, new in [(8, 4), (4, 8), (8, 3), (3, 8), (5, 3), (3, 7), (6, 6), (1, 5), (5, 1)]:
    weights = checkpoint_lib._interval_weights(old, new)
    assert all(abs(sum(w for _, w in row) - 1) < 1e-12 for row in weights)
    rows = rng.normal(size=(old, 2, 5)).astype(np.float32)
    moved = checkpoint_lib._redistribute_rows(rows, new)
    assert moved.shape == (new, 2, 5) and moved.dtype == np.float32
    np.testing.assert_allclose(moved.astype(np.float64).mean(0), rows.astype(np.float64).mean(0),
                               rtol=0, atol=np.finfo(np.float32).eps * np.abs(rows).max())
    equal = np.broadcast_to(rows[:1], rows.shape)
    np.testing.assert_array_equal(checkpoint_lib._redistribute_rows(equal, new),
                                  np.broadcast_to(rows[:1], (new, 2, 5)))
  pairs = checkpoint_lib._redistribute_rows(rows := rng.normal(size=(8, 1, 3)).astype(
      np.float32), 4)
  np.testing.assert_array_equal(pairs, ((rows[0::2].astype(np.float64) + rows[1::2]) / 2
                                        ).astype(np.float32))
  copies = checkpoint_lib._redistribute_rows(rows[:4], 8)
  np.testing.assert_array_equal(_bits(copies), _bits(np.repeat(rows[:4], 2, axis=0)))


def test_devices_of_one_shard_are_combined_only_when_the_fast_axis_keeps_its_size():
  """``(old rows, new rows, columns)`` of the map for saved axes and a new mesh."""
  grid = lambda names, sizes, shape, axes: checkpoint_lib._grid(
      {"names": names, "sizes": sizes}, training.make_mesh(shape, axes), axes)
  assert grid(["dcn", "ici"], [2, 4], (1, 4), ("dcn", "ici")) == (2, 1, 4)
  assert grid(["dcn", "ici"], [2, 4], (1, 4), ("slow", "fast")) == (2, 1, 4)  # renamed
  assert grid(["ici"], [4], (2, 4), ("dcn", "ici")) == (1, 2, 4)  # saved 1x4: dcn dropped
  assert grid(["x", "y"], [2, 4], (2, 2), ("x", "y")) == (8, 4, 1)  # columns differ
  assert grid(["data"], [8], (1, 4), ("x", "y")) == (8, 4, 1)  # a ring: one column
  assert grid(["data"], [8], 4, ("data",)) == (8, 4, 1)


def test_a_leaf_that_differs_between_devices_and_is_not_floating_is_named():
  rows = np.arange(8, dtype=np.uint32).reshape(8, 1, 1)
  with pytest.raises(ValueError, match=r"state leaf \[0\].rng_key \(uint32\) differs between"
                                       r" devices and is not floating"):
    checkpoint_lib._redistribute_rows(rows, 4, "state leaf [0].rng_key")


if __name__ == "__main__" and sys.argv[1:2] == ["restore"]:
  _restore_every_method(pathlib.Path(sys.argv[2]), sys.argv[3])
