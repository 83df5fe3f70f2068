"""`python -m experiments.compare --task lm` on tiny settings: outputs, bytes, goals."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import lm

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("lm")
  done = subprocess.run(
      [sys.executable, "-m", "experiments.compare", "--task", "lm", "--runs",
       "sync-dense,sync-demo,diloco-dense", "--pretrain-steps", "3", "--steps", "12",
       "--eval-every", "6",
       "--sync-period", "6", "--out", str(out), "--no-progress"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return out, done.stdout


def test_writes_the_table_the_json_and_both_plots(lm_run):
  out, stdout = lm_run
  assert {p.name for p in out.iterdir()} == {
      "lm.json", "lm.md", "lm_loss_vs_step.png", "lm_loss_vs_slow_bytes.png"}
  report = json.loads((out / "lm.json").read_text())
  assert list(report["runs"]) == ["sync-dense", "sync-demo", "diloco-dense"]
  assert report["config"]["steps"] == 12 and report["config"]["sync_period"] == 6
  assert report["config"]["pretrain_steps"] == 3
  assert report["config"]["pretrain_tokens"] == 3 * 64 * 64
  assert 0 < report["config"]["pretrain_val_loss"] < np.log(256) + 1
  for row in report["runs"].values():
    assert [h["step"] for h in row["history"]] == [6, 12]
    assert row["val_loss"] == row["history"][-1]["val_loss"] > 0
    assert row["bytes_match_formula"] and row["bytes_by_axes"] == row["bytes_by_axes_formula"]
  table = (out / "lm.md").read_text()
  assert "| diloco-dense | 6 | AdamW |" in table and "| sync-demo | 1 | signum |" in table
  assert "every run from one checkpoint (3 synchronous dense AdamW steps" in table
  assert "## Goals" in stdout


def test_diloco_dense_sends_h_times_fewer_slow_link_bytes_than_synchronous_dense(lm_run):
  report = json.loads((lm_run[0] / "lm.json").read_text())
  sync, diloco = report["runs"]["sync-dense"], report["runs"]["diloco-dense"]
  # Both all-reduce each device's quarter of the gradient over the two groups.
  assert sync["slow_bytes_per_step"] == diloco["slow_bytes_per_step"] * 6
  assert diloco["slow_bytes_reduction"] == 6
  assert sync["fast_bytes_per_step"] > 0 and diloco["fast_bytes_per_step"] > 0


def test_the_corpus_holds_out_every_tenth_module():
  train, validation = lm.corpus()
  assert len(lm.MODULES) == 75 and list(lm.MODULES) == sorted(lm.MODULES)
  assert 0.05 < len(validation) / (len(train) + len(validation)) < 0.2
  x, y = lm.eval_windows(validation, 16, 8)
  assert x.shape == y.shape == (8, 16) and (x[:, 1:] == y[:, :-1]).all()


def test_unknown_runs_are_refused_by_name():
  with pytest.raises(SystemExit):
    lm.config_from_args(["--runs", "diloco-nothing"])


def test_signum_steps_by_the_sign_of_the_mean_at_its_own_learning_rate():
  tx, schedule = lm.INNER["signum"](100), lm._schedule(100, lm.TRAIN["signum_peak_lr"])
  assert schedule(50) > 0 and schedule(50) != lm._schedule(100)(50)
  params = {"w": np.array([0.5, -2.0, 0.0], np.float32)}
  grads = {"w": np.array([3e-4, -7.0, 0.0], np.float32)}
  state = tx.init(params)
  for step in range(3):
    updates, state = tx.update(grads, state, params)
    want = -schedule(step) * (np.sign(grads["w"]) + lm.TRAIN["weight_decay"] * params["w"])
    np.testing.assert_allclose(updates["w"], want, rtol=1e-6)


def test_every_run_starts_from_the_pretrained_checkpoint(monkeypatch):
  from experiments import models
  from jaxcomp import training

  small = {"width": 16, "layers": 1, "heads": 2, "context": 8}
  for key, value in small.items():
    monkeypatch.setitem(lm.MODEL, key, value)
  monkeypatch.setitem(lm.TRAIN, "batch_per_device", 1)
  model = models.char_transformer(0, **small)
  mesh = training.make_mesh((lm.GROUPS, lm.GROUP_SIZE), (lm.SLOW, lm.FAST))
  stream = np.arange(1000, dtype=np.uint8)
  untouched, seconds = lm.pretrain(lm.Config(pretrain_steps=0), model, stream, mesh)
  assert untouched is model.params and seconds == 0
  params, _ = lm.pretrain(lm.Config(pretrain_steps=2, progress=False), model, stream, mesh)
  for before, after in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
    assert before.shape == after.shape and not np.array_equal(before, after)

  started = {}

  def train_run(name, config, model, *rest):
    started[name] = model.params
    return {"val_loss": 1.0, "slow_bytes_per_step": 1.0}

  monkeypatch.setattr(lm, "train_run", train_run)
  monkeypatch.setattr(lm, "pretrain", lambda *a: (params, 0.0))
  monkeypatch.setattr(lm, "write", lambda *a: None)
  monkeypatch.setattr(lm, "check_goals", lambda report: [])
  report = lm.run(lm.Config(runs=("sync-dense", "diloco-dense"), progress=False))
  assert set(started) == {"sync-dense", "diloco-dense"}
  assert all(p is params for p in started.values())
  assert report["config"]["pretrain_val_loss"] > 0


def test_a_negative_pretraining_is_refused():
  with pytest.raises(SystemExit):
    lm.config_from_args(["--pretrain-steps", "-1"])
