"""Reliability of every registered compressor, trained end to end on 8 fake CPU devices.

For every compressor and layout one run of 60 steps of a small MLP records
what the tests read. The layouts: a ring of 8 on axis ``data`` and a 2x4
torus on ``("x", "y")`` (:func:`jaxcomp.training.make_step`); on a 2x4 mesh
``("dcn", "ici")``, the compressor on the slow axis only, with replicated
parameters (:func:`jaxcomp.hierarchical`, ``hierarchical``) and with the
parameters sharded over the fast axis (:func:`jaxcomp.training.make_fsdp_step`,
``fsdp``). Recorded:

* the parameters on every device at steps 50 and 60 (replica sync);
* how often the step was traced (compile once, DGC's warm-up and ACP-SGD's
  alternation included);
* a non-finite gradient on one device at step ``BAD_STEP`` (Inf on the torus,
  NaN elsewhere): on the torus ``optax.apply_if_finite`` placed after the
  compressor drops it, elsewhere the training helper's own skip does;
* a checkpoint written at step 25 (inside DGC's warm-up), which a fresh
  process restores and trains for 25 more steps: bit for bit the run's state
  at step 50 (one process per layout resumes every method; restoring onto
  another device count is ``tests/test_checkpoint.py``'s).

Run as a script (``python tests/test_reliability.py resume ...``) this module
is that fresh process.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import traceback

import jax

if __name__ == "__main__":  # the fresh process of the resume test
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np
import optax
import pytest

import harness
import jaxcomp
from jaxcomp import registry
from jaxcomp import training

STEPS = 60
CHECKPOINT_STEP = 25
RESUME_STEPS = 25
BAD_STEP = 20
BAD_DEVICE = 3
PER_DEVICE_BATCH = 8
MESHES = {"ring": (8, ("data",)), "torus": ((2, 4), ("x", "y")),
          "hierarchical": ((2, 4), ("dcn", "ici")), "fsdp": ((2, 4), ("dcn", "ici"))}
SLOW, FAST = "dcn", "ici"

# Every registered method, configured for the MLP below (n = 676): what a
# model this small needs to send anything, and DGC with momentum correction,
# clipping, masking and warm-up. Its 640 sparse entries select by lax.top_k
# (the sampled threshold takes 4,096 or more on CPU: test_dgc and
# test_selection run it).
SMALL_MODEL = {"density": 0.05, "rank": 2, "levels": 8, "bucket_size": 128}
EXTRA = {"randomk": {"density": 0.1, "seed": 1},
         "dgc": {"density": 0.01, "momentum": 0.9, "clip_norm": 1.0, "warmup_steps": 40}}


def _compressor(name: str, axis):
  defaults = registry.get(name).defaults
  config = {k: v for k, v in SMALL_MODEL.items() if k in defaults}
  return registry.build(name, axis, **{**config, **EXTRA.get(name, {})})


COMPRESSORS = {name: functools.partial(_compressor, name) for name in registry.names()}
CASES = [(name, mesh) for name in COMPRESSORS for mesh in MESHES]


def _axis(names):
  return names[0] if len(names) == 1 else names


def _optimizer(name: str, mesh_name: str) -> optax.GradientTransformation:
  """SGD behind ``apply_if_finite`` on the torus, adamw (SGD after DGC) elsewhere.

  DGC carries its momentum inside, so plain SGD follows it (the registry
  refuses a momentum optimizer after it).
  """
  carries_momentum = bool(registry.get(name).forbids_after)
  if mesh_name != "torus":
    return optax.sgd(0.05) if carries_momentum else optax.adamw(1e-2)
  sgd = optax.sgd(0.05) if carries_momentum else optax.sgd(0.05, momentum=0.9)
  return optax.apply_if_finite(sgd, max_consecutive_errors=5)


def _init_params():
  rng = np.random.default_rng(0)
  return {
      "hidden": {"kernel": rng.normal(0, 0.25, (16, 32)).astype(np.float32),
                 "bias": np.zeros(32, np.float32)},
      "out": {"kernel": rng.normal(0, 0.18, (32, 4)).astype(np.float32),
              "bias": np.zeros(4, np.float32)},
  }


def _loss(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  logits = hidden @ params["out"]["kernel"] + params["out"]["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batch(step: int, devices: int, bad: float):
  """Step ``step``'s batch: a fixed teacher's labels; ``bad`` on one device at ``BAD_STEP``."""
  rng = np.random.default_rng(1000 + step)
  x = rng.normal(size=(devices * PER_DEVICE_BATCH, 16)).astype(np.float32)
  teacher = np.random.default_rng(7).normal(size=(16, 4)).astype(np.float32)
  y = np.argmax(x @ teacher, axis=1).astype(np.int32)
  if step == BAD_STEP:
    x[BAD_DEVICE * PER_DEVICE_BATCH] = bad
  return {"x": x, "y": y}


class _Setup:
  """Mesh, transformation and jitted step of one case, with a trace counter."""

  def __init__(self, name: str, mesh_name: str):
    shape, names = MESHES[mesh_name]
    self.axis = _axis(names)
    self.mesh = training.make_mesh(shape, names)
    self.devices = training.num_replicas(self.mesh, self.axis)
    self.fsdp = mesh_name == "fsdp"
    self.helper_skips = mesh_name != "torus"
    self.bad = np.inf if mesh_name == "torus" else np.nan
    if mesh_name == "hierarchical":
      compressor = jaxcomp.hierarchical(COMPRESSORS[name](SLOW), FAST, shape[1])
    else:
      compressor = COMPRESSORS[name](SLOW if self.fsdp else self.axis)
    self.tx = optax.chain(compressor, _optimizer(name, mesh_name))
    self.traces = 0

    def counted_loss(params, batch):
      self.traces += 1
      return _loss(params, batch)

    if self.fsdp:
      self.step = training.make_fsdp_step(
          counted_loss, self.tx, self.mesh, SLOW, FAST, _init_params())
    else:
      self.step = training.make_step(
          counted_loss, self.tx, self.mesh, self.axis, skip_nonfinite=self.helper_skips)

  def fresh(self):
    params = _init_params()
    if self.fsdp:
      return (training.shard_params(params, self.mesh, FAST),
              training.init_fsdp_state(self.tx, params, self.mesh, SLOW, FAST))
    return (training.replicate(params, self.mesh),
            training.init_state(self.tx, params, self.mesh, self.axis))

  def restore(self, directory: str):
    """``fresh()``'s parameters and state, read from the checkpoint in ``directory``."""
    params, state = self.fresh()
    spec = jax.sharding.PartitionSpec(FAST if self.fsdp else None)
    return training.restore_checkpoint(
        directory, params, state, self.mesh, self.axis, params_spec=spec)

  def twin(self, device: int) -> int:
    """The device whose parameters ``device``'s must equal: same row block under FSDP."""
    return device % self.mesh.shape[FAST] if self.fsdp else 0

  def train(self, params, state, first: int, last: int, on_step=None):
    """Steps ``first`` to ``last - 1``; ``on_step(step, params, state, metrics)`` after each."""
    for step in range(first, last):
      batch = training.shard(_batch(step, self.devices, self.bad), self.mesh, self.axis)
      # Blocked on every step: queued steps make XLA:CPU abort its collectives.
      params, state, metrics = jax.block_until_ready(self.step(params, state, batch))
      if on_step is not None:
        on_step(step + 1, params, state, metrics)
    return params, state


def _per_device(tree):
  """Every leaf as ``[devices, ...]`` numpy, one row per device's own buffer."""

  def rows(x):
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    stacked = x.shape[0] == len(shards) and all(s.data.shape[0] == 1 for s in shards)
    if stacked and not x.sharding.is_fully_replicated:
      return np.asarray(x)  # the per-device state: one row per device already
    return np.stack([np.asarray(s.data) for s in shards])  # parameters, whole or row blocks

  return jax.tree.map(rows, tree)


def _flat(tree) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@functools.lru_cache(maxsize=None)
def _run(name: str, mesh_name: str, checkpoint_dir: str):
  setup = _Setup(name, mesh_name)
  params, state = setup.fresh()
  record = {"finite": {}, "loss": {}, "params": {}, "state": {}}

  def on_step(step, params, state, metrics):
    record["finite"][step] = np.asarray(metrics["finite"])
    record["loss"][step] = np.asarray(metrics["loss"])
    if step in (BAD_STEP, BAD_STEP + 1, CHECKPOINT_STEP + RESUME_STEPS, STEPS):
      record["params"][step] = _per_device(params)
      record["state"][step] = _per_device(state)
    if step == CHECKPOINT_STEP:
      training.save_checkpoint(checkpoint_dir, params, state, step)

  setup.train(params, state, 0, STEPS, on_step)
  record["traces"] = setup.traces
  record["setup"] = setup
  return record


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> pathlib.Path:
  """Where the runs write their step-25 checkpoints (one directory per case)."""
  return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def run(checkpoints):
  return lambda name, mesh_name: _run(name, mesh_name, str(checkpoints / f"{name}-{mesh_name}"))


# ------------------------------------------------------------- replica sync


@pytest.mark.parametrize("name,mesh_name", CASES)
def test_replicas_stay_bitwise_identical(run, name, mesh_name):
  record = run(name, mesh_name)
  twin = record["setup"].twin
  for step in (CHECKPOINT_STEP + RESUME_STEPS, STEPS):
    for leaf in _flat(record["params"][step]):
      for device in range(1, leaf.shape[0]):
        np.testing.assert_array_equal(
            leaf[device], leaf[twin(device)], err_msg=f"step {step}, device {device}")
  # The first ten steps against the last ten: one step's loss on its own batch is noisy.
  window = lambda start: np.mean([record["loss"][s].mean() for s in range(start, start + 10)])
  first, last = window(1), window(STEPS - 9)
  assert last < first, f"{name} did not learn: mean loss {first} -> {last}"


@pytest.mark.parametrize("name,mesh_name", CASES)
def test_compiles_once_per_form_over_the_run(run, name, mesh_name):
  """One program per form of the step, picked on the host: ACP-SGD's P and Q
  steps, DGC's warm-up stages above its density and the steady state."""
  record = run(name, mesh_name)
  # DGC at 1%: its stages at 25%, 6.25% and 1.5625%, then 1% (0.4% raised to it).
  forms = {"acpsgd": 2, "dgc": 4}.get(name, 1)
  assert record["traces"] == forms
  assert record["setup"].step.cache_size() == forms


# --------------------------------------------------------- non-finite input


@pytest.mark.parametrize("name,mesh_name", CASES)
def test_non_finite_on_one_device_skips_the_step_everywhere(run, name, mesh_name):
  record = run(name, mesh_name)
  before, after = BAD_STEP, BAD_STEP + 1
  for leaf_before, leaf_after in zip(_flat(record["params"][before]),
                                     _flat(record["params"][after])):
    np.testing.assert_array_equal(leaf_after, leaf_before)
  if record["setup"].helper_skips:
    assert not record["finite"][after].any()
    assert all(record["finite"][s].all() for s in record["finite"] if s != after)
  else:  # apply_if_finite after the compressor counted it on every device
    counters = record["state"][STEPS][1]
    np.testing.assert_array_equal(counters.total_notfinite, np.ones(8))
    np.testing.assert_array_equal(counters.notfinite_count, np.zeros(8))
  for step in record["state"]:
    for leaf in _flat(record["state"][step]):
      if np.issubdtype(leaf.dtype, np.floating):
        assert np.isfinite(leaf).all(), f"non-finite state at step {step}"
  assert np.isfinite(record["loss"][STEPS]).all()


# ----------------------------------------------------------------- checkpoints


def _resume(name: str, mesh_name: str, checkpoint_dir: str, out: str) -> None:
  """Restores step 25, trains 25 steps, saves every device's state."""
  setup = _Setup(name, mesh_name)
  params, state, step = setup.restore(checkpoint_dir)
  assert step == CHECKPOINT_STEP, step
  params, state = setup.train(params, state, step, step + RESUME_STEPS)
  leaves = _flat(_per_device(params)) + _flat(_per_device(state))
  np.savez(out, *leaves)


def _resume_layout(mesh_name: str, checkpoints: str, out: str) -> None:
  """The fresh process: every method of one layout resumed, each into ``NAME-LAYOUT.npz``.

  A method that fails leaves its traceback in ``NAME-LAYOUT.txt`` instead, and
  the others' results.
  """
  for name in COMPRESSORS:
    case = f"{name}-{mesh_name}"
    try:
      _resume(name, mesh_name, os.path.join(checkpoints, case), os.path.join(out, case + ".npz"))
    except Exception:  # pylint: disable=broad-except
      pathlib.Path(out, case + ".txt").write_text(traceback.format_exc())


@pytest.fixture(scope="module")
def resumed(run, checkpoints, tmp_path_factory):
  """``resumed(mesh_name) -> (process, directory)``: one fresh process resumes every
  method of the layout from its step-25 checkpoint, the first time it is asked for."""
  out = tmp_path_factory.mktemp("resumed")

  @functools.lru_cache(maxsize=None)
  def resume(mesh_name: str):
    for name in COMPRESSORS:
      run(name, mesh_name)  # writes the checkpoint to resume
    done = subprocess.run(
        [sys.executable, __file__, "resume", mesh_name, str(checkpoints), str(out)],
        capture_output=True, text=True, timeout=600,
        env=harness.fresh_process_env())
    return done, out

  return resume


@pytest.mark.parametrize("name,mesh_name", CASES)
def test_checkpoint_resumes_bit_exactly_in_a_fresh_process(run, resumed, name, mesh_name):
  record = run(name, mesh_name)
  done, out = resumed(mesh_name)
  assert done.returncode == 0, done.stdout + done.stderr
  failed = out / f"{name}-{mesh_name}.txt"
  assert not failed.exists(), failed.read_text()
  step = CHECKPOINT_STEP + RESUME_STEPS
  want = _flat(record["params"][step]) + _flat(record["state"][step])
  with np.load(out / f"{name}-{mesh_name}.npz") as got:
    assert len(got.files) == len(want)
    for i, expected in enumerate(want):
      np.testing.assert_array_equal(got[f"arr_{i}"], expected, err_msg=f"leaf {i}")


def test_the_fresh_process_imports_the_jaxcomp_under_test(tmp_path, monkeypatch):
  """A script run from ``tests/`` finds ``jaxcomp`` on ``PYTHONPATH`` or in the
  environment's packages, which may be another copy than this checkout's (a
  ``jaxcomp`` installed without ``-e``): the fresh process would then resume with
  code this run does not test. A decoy first on ``PYTHONPATH`` stands for it."""
  decoy = tmp_path / "jaxcomp"
  decoy.mkdir()
  (decoy / "__init__.py").write_text("")
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  done = subprocess.run(
      [sys.executable, "-c", "import jaxcomp; print(jaxcomp.__file__)"],
      cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=120,
      env=harness.fresh_process_env())
  assert done.returncode == 0, done.stderr
  assert pathlib.Path(done.stdout.strip()).resolve() == pathlib.Path(jaxcomp.__file__).resolve()


# ------------------------------------------------------------------ bad input

# One row per line of the README's table: (call, error, what the message says).
BAD_ARGUMENTS = {
    "density 0": (lambda: jaxcomp.topk(0.0, "data"), ValueError, r"`density` must be in \(0, 1\]"),
    "density > 1": (lambda: jaxcomp.gtopk(1.5, "data"), ValueError, r"`density` must be in \(0, 1\]"),
    "density NaN": (lambda: jaxcomp.randomk(float("nan"), "data"), ValueError, r"`density` must be in \(0, 1\]"),
    "density not a number": (lambda: jaxcomp.dgc("0.1", "data"), TypeError, r"`density`"),
    "rank < 1": (lambda: jaxcomp.powersgd(0, "data"), ValueError, r"`rank` must be in \[1, inf\)"),
    "rank not an int": (lambda: jaxcomp.acpsgd(1.5, "data"), TypeError,
                        r"`rank` must be an int in \[1, inf\)"),
    "min_compression_rate < 1": (
        lambda: jaxcomp.powersgd(2, "data", min_compression_rate=0.5), ValueError,
        r"`min_compression_rate` must be in \[1, inf\)"),
    "momentum >= 1": (lambda: jaxcomp.dgc(0.01, "data", momentum=1.0), ValueError,
                      r"`momentum` must be in \[0, 1\)"),
    "momentum < 0": (lambda: jaxcomp.dgc(0.01, "data", momentum=-0.1), ValueError,
                     r"`momentum` must be in \[0, 1\)"),
    "sample_ratio 0": (lambda: jaxcomp.dgc(0.01, "data", sample_ratio=0.0), ValueError,
                       r"`sample_ratio` must be in \(0, 1\]"),
    "warmup_steps < 0": (lambda: jaxcomp.dgc(0.01, "data", warmup_steps=-1), ValueError,
                         r"`warmup_steps` must be in \[0, inf\)"),
    "clip_norm <= 0": (lambda: jaxcomp.dgc(0.01, "data", clip_norm=0.0), ValueError,
                       r"`clip_norm` must be None or in \(0, inf\)"),
    "cast to an integer dtype": (lambda: jaxcomp.cast(jnp.int32, "data"), TypeError,
                                 r"`dtype` must be a 16- or 32-bit floating dtype"),
    "cast to float64": (lambda: jaxcomp.cast(jnp.float64, "data"), TypeError,
                        r"`dtype` must be a 16- or 32-bit floating dtype"),
    "seed out of range": (lambda: jaxcomp.randomk(0.1, "data", seed=-1), ValueError,
                          r"`seed` must be in \[0, 2\*\*32\)"),
    "levels out of range": (lambda: jaxcomp.qsgd(128, "data"), ValueError,
                            r"`levels` must be in \[1, 127\]"),
    "flag not a bool": (lambda: jaxcomp.signsgd("data", majority_vote="yes"), TypeError,
                        r"`majority_vote` must be a bool"),
    "empty axis name": (lambda: jaxcomp.allreduce(""), ValueError, r"`axis_name` must be a non-empty"),
    "axis name not a string": (lambda: jaxcomp.topk(0.1, 0), TypeError, r"`axis_name` must be"),
    "axis pair of equal names": (lambda: jaxcomp.acpsgd(2, ("x", "x")), ValueError,
                                 r"`axis_name` pair must name two distinct mesh axes"),
    "three axis names": (lambda: jaxcomp.powersgd(2, ("x", "y", "z")), ValueError,
                         r"`axis_name` as a sequence must be a pair"),
}


@pytest.mark.parametrize("row", BAD_ARGUMENTS)
def test_bad_argument_is_named_at_construction(row):
  make, error, message = BAD_ARGUMENTS[row]
  with pytest.raises(error, match=message):
    make()


# One rule for every hyperparameter: numpy scalars of the right kind are numbers.
NUMPY_SCALARS = {
    "density": lambda: jaxcomp.topk(np.float32(0.25), "data"),
    "rank": lambda: jaxcomp.powersgd(np.int64(2), "data"),
    "min_compression_rate": lambda: jaxcomp.acpsgd(2, "data", np.float32(1.5)),
    "seed": lambda: jaxcomp.randomk(0.1, "data", seed=np.uint32(7)),
    "momentum, warmup_steps, clip_norm, sample_ratio": lambda: jaxcomp.dgc(
        np.float64(0.01), "data", momentum=np.float32(0.5), warmup_steps=np.int32(8),
        clip_norm=np.float32(2.0), sample_ratio=np.float16(0.5)),
    "levels, bucket_size": lambda: jaxcomp.qsgd(np.int8(4), "data", bucket_size=np.int64(64)),
    "a flag": lambda: jaxcomp.signsgd("data", majority_vote=np.bool_(True)),
}


@pytest.mark.parametrize("row", NUMPY_SCALARS)
def test_numpy_scalars_of_the_right_kind_are_accepted(row):
  tx = NUMPY_SCALARS[row]()
  config = jaxcomp.protocol.spec(tx).config
  for value in config.values():  # stored as plain Python values
    assert not isinstance(value, np.generic)


@pytest.mark.parametrize("call,error", [
    (lambda: jaxcomp.powersgd(np.float32(2.0), "data"), TypeError),
    (lambda: jaxcomp.topk(np.bool_(True), "data"), TypeError),
    (lambda: jaxcomp.dgc(0.1, "data", warmup_steps=np.float32(3.0)), TypeError),
    (lambda: jaxcomp.topk(np.array([0.1]), "data"), TypeError),
])
def test_numpy_values_of_the_wrong_kind_are_refused(call, error):
  with pytest.raises(error):
    call()


def _update_on_ring(tx, params, grads):
  """``tx.update`` on 8 devices of axis ``data`` (traced, so checks at first trace run)."""
  mesh = training.make_mesh(8)
  state = training.init_state(tx, params, mesh, "data")
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (8,) + x.shape), grads)
  return training.make_update(tx, mesh, "data")(training.shard(stacked, mesh, "data"), state)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_unknown_axis_is_named_at_first_trace(name):
  params = {"w": np.ones((6, 4), np.float32)}
  with pytest.raises(ValueError, match=r"`axis_name` 'model' is not a bound mesh axis"):
    _update_on_ring(COMPRESSORS[name]("model"), params, params)


def _keeps_per_leaf_state(name: str) -> bool:
  """Whether the method's default state holds arrays shaped like the parameters."""
  state = COMPRESSORS[name]("data").init({"w": np.ones((6, 4), np.float32)})
  return any(np.shape(x) == (6, 4) for x in jax.tree.leaves(state))


@pytest.mark.parametrize("name", [n for n in COMPRESSORS if _keeps_per_leaf_state(n)])
def test_updates_unlike_the_params_are_named_at_first_trace(name):
  params = {"w": np.ones((6, 4), np.float32), "b": np.ones(4, np.float32)}
  grads = {"w": np.ones((6, 5), np.float32), "b": np.ones(4, np.float32)}
  with pytest.raises(ValueError, match=r"`updates`"):
    _update_on_ring(COMPRESSORS[name]("data"), params, grads)


if __name__ == "__main__" and sys.argv[1:2] == ["resume"]:
  _resume_layout(*sys.argv[2:5])
