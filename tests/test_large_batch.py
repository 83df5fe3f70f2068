"""The 2D-torus paper's large-batch recipe: batch-size control and label smoothing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from experiments import compare
from experiments import data
from jaxcomp import training

SIZES = {0: 8, 3: 16, 5: 32}


# ------------------------------------------------------------ the schedule


def test_schedule_gives_each_steps_size_on_the_host_and_traced():
  sizes = training.batch_size_schedule({5: 32, 0: 8, 3: 16})
  assert sizes.boundaries == (0, 3, 5) and sizes.sizes == (8, 16, 32)
  expected = [8, 8, 8, 16, 16, 32, 32, 32]
  assert [sizes(i) for i in range(8)] == expected
  assert all(type(sizes(i)) is int for i in range(8))
  traced = jax.jit(jax.vmap(sizes))(jnp.arange(8, dtype=jnp.int32))
  np.testing.assert_array_equal(traced, expected)
  assert sizes(10**6) == 32
  # Examples drawn: 3 x 8 + 2 x 16 + 32 per step after.
  assert [sizes.examples(n) for n in (0, 1, 3, 4, 5, 7)] == [0, 8, 24, 40, 56, 120]
  with pytest.raises(ValueError, match="`step` must be >= 0"):
    sizes(-1)


@pytest.mark.parametrize("value, error, message", [
    ({}, ValueError, "batch size at step 0"),
    ({1: 8, 4: 16}, ValueError, "batch size at step 0"),
    ({-1: 8, 0: 16}, ValueError, r"`boundaries_and_sizes step` must be in \[0, inf\)"),
    ({0: 0}, ValueError, r"`boundaries_and_sizes size` must be in \[1, inf\)"),
    ({0: 8, 4: 8}, ValueError, "must grow strictly"),
    ({0: 16, 4: 8}, ValueError, "got 16 at step 0 and 8 at step 4"),
    ({0: 8.0}, TypeError, "`boundaries_and_sizes size` must be an int"),
    ({0: True}, TypeError, "`boundaries_and_sizes size` must be an int"),
    ({0.5: 8}, TypeError, "`boundaries_and_sizes step` must be an int"),
    ([8, 16], TypeError, "must be a dict"),
], ids=["empty", "no-step-0", "negative-step", "zero-size", "constant", "shrinking",
        "float-size", "bool-size", "float-step", "list"])
def test_schedule_refuses_bad_input_by_name(value, error, message):
  with pytest.raises(error, match=message):
    training.batch_size_schedule(value)


def test_sizes_must_split_evenly_over_the_devices():
  with pytest.raises(ValueError, match="size 12 .from step 4. must be a multiple of `num_replicas` 8"):
    training.batch_size_schedule({0: 8, 4: 12}, num_replicas=8)
  with pytest.raises(ValueError, match=r"`num_replicas` must be in \[1, inf\)"):
    training.batch_size_schedule({0: 8}, num_replicas=0)
  assert training.batch_size_schedule({0: 8, 4: 24}, num_replicas=8).sizes == (8, 24)
  mesh = training.make_mesh(8)
  training.check_batch_sizes(training.batch_size_schedule(SIZES), mesh, "data")
  with pytest.raises(ValueError, match="size 20 .from step 3. is not a multiple of the 8 devices"):
    training.check_batch_sizes(training.batch_size_schedule({0: 8, 3: 20}), mesh, "data")
  torus = training.make_mesh((2, 4), ("x", "y"))
  with pytest.raises(ValueError, match="the 8 devices along `axis_name`"):
    training.check_batch_sizes(training.batch_size_schedule({0: 4}), torus, ("x", "y"))
  training.check_batch_sizes(training.batch_size_schedule({0: 2}), torus, "x")


def test_learning_rate_scales_linearly_with_the_batch():
  sizes = training.batch_size_schedule(SIZES)
  constant = training.batch_scaled_learning_rate(0.1, sizes, 8)
  decaying = training.batch_scaled_learning_rate(lambda count: 0.1 / (1 + count), sizes, 8)
  for count in range(8):
    assert float(constant(jnp.int32(count))) == pytest.approx(0.1 * sizes(count) / 8)
    assert float(decaying(jnp.int32(count))) == pytest.approx(0.1 / (1 + count) * sizes(count) / 8)
  with pytest.raises(ValueError, match="`base_batch_size`"):
    training.batch_scaled_learning_rate(0.1, sizes, 0)
  with pytest.raises(TypeError, match="`learning_rate`"):
    training.batch_scaled_learning_rate("0.1", sizes, 8)


# ------------------------------------------------- one compile per batch size


def _problem():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), "b": jnp.zeros(4)}
  teacher = rng.normal(size=(6, 4))

  def batch(size, step):
    x = np.random.default_rng(step).normal(size=(size, 6)).astype(np.float32)
    return x, np.argmax(x @ teacher, 1).astype(np.int32)

  return params, batch


@pytest.mark.parametrize("compressor", ["allreduce", "gtopk"])
def test_a_growing_batch_compiles_the_step_once_per_size(compressor):
  params, batch = _problem()
  mesh = training.make_mesh(8)
  sizes = training.batch_size_schedule(SIZES)
  tx = optax.chain(jaxcomp.registry.build(compressor, "data"),
                   optax.sgd(training.batch_scaled_learning_rate(0.05, sizes, 8), momentum=0.9))
  traces = []

  def loss(p, b):
    traces.append(b[0].shape)
    logits = b[0] @ p["w"] + p["b"]
    targets = optax.smooth_labels(jax.nn.one_hot(b[1], logits.shape[-1]), 0.1)
    return optax.softmax_cross_entropy(logits, targets).mean()

  # Through the jitted step: it retraces once per new batch shape.
  step = training.make_step(loss, tx, mesh, "data")
  p = training.replicate(params, mesh)
  s = training.init_state(tx, p, mesh, "data")
  jitted = []
  for i in range(8):
    p, s, metrics = step(p, s, training.shard(batch(sizes(i), i), mesh, "data"))
    jax.block_until_ready(metrics["loss"])
    jitted.append(jax.tree.map(np.asarray, p))  # the next step donates p
  assert step.cache_size() == 3
  # Each device's part of the batch: 1, 2, then 4 examples.
  assert traces == [(1, 6), (2, 6), (4, 6)]

  # Ahead of time: one compiled step per size, then no trace at all.
  traces.clear()
  step = training.make_step(loss, tx, mesh, "data")
  p = training.replicate(params, mesh)
  s = training.init_state(tx, p, mesh, "data")
  compiled = training.compile_batch_sizes(step, p, s, batch(8, 0), sizes, mesh, "data")
  assert sorted(compiled) == [8, 16, 32] and len(traces) == 3
  for i in range(8):
    p, s, metrics = compiled[sizes(i)](p, s, training.shard(batch(sizes(i), i), mesh, "data"))
    jax.block_until_ready(metrics["loss"])
    # The same programs: the same parameters bit for bit, step by step.
    jax.tree.map(np.testing.assert_array_equal, p, jitted[i])
  assert len(traces) == 3
  assert bool(jnp.all(metrics["finite"]))


def test_compile_batch_sizes_refuses_sizes_that_do_not_split():
  params, batch = _problem()
  mesh = training.make_mesh(8)
  tx = optax.sgd(0.1)
  step = training.make_step(lambda p, b: jnp.sum(b[0] @ p["w"]), tx, mesh, "data")
  p = training.replicate(params, mesh)
  s = training.init_state(tx, p, mesh, "data")
  with pytest.raises(ValueError, match="size 12"):
    training.compile_batch_sizes(step, p, s, batch(8, 0),
                                 training.batch_size_schedule({0: 8, 2: 12}), mesh, "data")


# ------------------------------------------------------------ the main job


def test_large_batch_schedules_draw_the_same_examples():
  schedules = compare.large_batch_schedules(150)
  assert {k: (s.sizes, n) for k, (s, n) in schedules.items()} == {
      "small": ((256,), 600), "large": ((1024,), 150), "control": ((256, 512, 1024), 300)}
  assert schedules["control"][0].boundaries == (0, 150, 225)
  assert {s.examples(n) for s, n in schedules.values()} == {150 * 1024}


def test_a_constant_schedule_draws_the_main_jobs_batches():
  split = data.digits().train
  ours = compare.scheduled_image_batches(split, training.batch_size_schedule({0: 256}), 3)
  theirs = data.image_batches(split, 256, 3)
  for _ in range(12):
    (x, y), (x2, y2) = next(ours), next(theirs)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
  growing = compare.scheduled_image_batches(split, training.batch_size_schedule({0: 256, 2: 1024}), 0)
  assert [len(next(growing)[1]) for _ in range(4)] == [256, 256, 1024, 1024]


def test_large_batch_flags():
  config = compare.config_from_args(["--large-batch"])
  assert config.large_batch and config.steps == 150 and config.repeats == 3
  assert config.methods == compare.LARGE_BATCH["methods"]
  assert compare.config_from_args(["--large-batch", "--full"]).steps == 500
  assert not compare.config_from_args([]).large_batch
  for argv in (["--repeats", "2"], ["--large-batch", "--task", "text"],
               ["--large-batch", "--mesh", "2x4", "--layout", "fsdp"]):
    with pytest.raises(SystemExit):
      compare.config_from_args(argv)
  assert "--large-batch" in compare.parser().format_help()


def test_main_job_flag_writes_the_table(tmp_path, capsys):
  compare.main(["--large-batch", "--methods", "allreduce", "--steps", "2", "--repeats", "2",
                "--eval-every", "1", "--out", str(tmp_path), "--no-progress"])
  report = json.loads((tmp_path / "large_batch.json").read_text())
  runs = report["methods"]["allreduce"]["runs"]
  assert list(runs) == list(compare.LARGE_BATCH_RUNS)
  assert {name: (r["steps"], r["compiles"], r["label_smoothing"]) for name, r in runs.items()} == {
      "small batch (reference)": (8, 1, 0.0),
      "large batch": (2, 1, 0.0),
      "large batch, rate not scaled": (2, 1, 0.0),
      "large + batch-size control": (4, 3, 0.0),
      "large + label smoothing": (2, 1, 0.1),
      "large + both (the recipe)": (4, 3, 0.1),
  }
  for r in runs.values():
    assert r["examples"] == 2048
    assert [s["seed"] for s in r["seeds"]] == [0, 1]
    assert [h["step"] for h in r["seeds"][0]["history"]] == list(range(1, r["steps"] + 1))
    accuracies = [s["final_accuracy"] for s in r["seeds"]]
    assert r["accuracy_mean"] == pytest.approx(np.mean(accuracies))
    assert r["accuracy_sd"] == pytest.approx(np.std(accuracies, ddof=1))
  control = runs["large + batch-size control"]
  assert control["batch_sizes"] == {"0": 256, "2": 512, "3": 1024}
  table = (tmp_path / "large_batch.md").read_text()
  recipe = runs["large + both (the recipe)"]
  assert (f"| allreduce | large + both (the recipe) | 0: 256, 2: 512, 3: 1024 | 4 | 0.4 | 0.1"
          f" | {recipe['accuracy_mean']:.4f} ± {recipe['accuracy_sd']:.4f} |") in table
  assert [r["peak_learning_rate"] for r in runs.values()] == [0.1, 0.4, 0.1, 0.4, 0.4, 0.4]
  assert "- **allreduce**" in table and "the recipe against the large batch" in table
  assert table in capsys.readouterr().out


def test_verdict_needs_more_than_seed_noise():
  def row(mean, sd):
    return {"accuracy_mean": mean, "accuracy_sd": sd}
  assert compare.large_batch_verdict(row(0.97, 0.005), row(0.95, 0.005), 3).endswith("helps")
  assert compare.large_batch_verdict(row(0.93, 0.005), row(0.95, 0.005), 3).endswith("hurts")
  assert compare.large_batch_verdict(row(0.955, 0.01), row(0.95, 0.01), 3).endswith("seed noise")
  assert "one seed" in compare.large_batch_verdict(row(0.97, 0.0), row(0.95, 0.0), 1)
