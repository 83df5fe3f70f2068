"""`python -m experiments.compare` on tiny settings: bytes, schedules, goals, outputs."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from experiments import compare
from experiments import models
from jaxcomp import registry
from jaxcomp import training
from jaxcomp import wire

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW_KEYS = {
    "final_accuracy", "final_loss", "bytes_per_step", "bytes_per_step_formula",
    "bytes_per_step_run_average", "bytes_per_step_run_average_formula", "compression_ratio",
    "message_bytes", "step_time_s", "compute_s", "exchange_s",
    "predicted_step_s", "skipped_steps", "configuration", "history",
}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("compare")
  done = subprocess.run(
      [sys.executable, "-m", "experiments.compare", "--methods", "allreduce,cast",
       "--steps", "20", "--eval-every", "10", "--out", str(out), "--no-progress"],
      cwd=ROOT, capture_output=True, text=True, timeout=110,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return out, done.stdout


def test_writes_json_table_and_plots(cli_run):
  out, stdout = cli_run
  assert {p.name for p in out.iterdir()} >= {
      "compare.json", "compare.md", "accuracy_vs_step.png", "accuracy_vs_bytes.png"}
  report = json.loads((out / "compare.json").read_text())
  config = report["config"]
  assert config["task"] == "digits" and config["steps"] == 20 and config["devices"] == 8
  assert config["evaluated_on"] == "test"
  assert list(report["methods"]) == ["allreduce", "cast"]
  for row in report["methods"].values():
    assert ROW_KEYS <= set(row)
    assert 0.0 <= row["final_accuracy"] <= 1.0
    assert row["bytes_per_step"] == row["bytes_per_step_formula"] > 0
    assert row["bytes_per_step_run_average"] == row["bytes_per_step"]
    assert row["predicted_step_s"] == pytest.approx(row["compute_s"] + row["exchange_s"])
    assert [h["step"] for h in row["history"]] == [10, 20]
    assert row["final_accuracy"] == row["history"][-1]["eval_accuracy"]
  dense, cast = report["methods"]["allreduce"], report["methods"]["cast"]
  n = config["num_params"]
  assert dense["bytes_per_step"] == 2 * 7 / 8 * 4 * n
  assert dense["compression_ratio"] == 1.0
  assert cast["compression_ratio"] == pytest.approx(2.0, rel=1e-4)
  assert cast["bytes_per_step"] == pytest.approx(dense["bytes_per_step"] / 2, rel=1e-4)
  table = (out / "compare.md").read_text()
  assert "| allreduce |" in table and "| cast |" in table and "0.5x" in table
  assert "| cast |" in stdout


def test_torus_mesh_in_process(tmp_path):
  config = compare.config_from_args(
      ["--methods", "allreduce", "--mesh", "2x4", "--steps", "4", "--eval-every", "2",
       "--out", str(tmp_path), "--no-progress"])
  assert config.devices == 8 and config.num_devices == (2, 4)
  report = compare.run(config)
  row = report["methods"]["allreduce"]
  assert report["config"]["mesh"] == [2, 4]
  assert row["bytes_per_step"] == row["bytes_per_step_formula"]
  assert set(row["bytes_by_kind"]) == {"reduce-scatter", "all-reduce", "all-gather"}


def test_text_task_trains_the_transformer_and_reports_bits_per_char(tmp_path):
  # On 2 devices: the transformer's steps are most of the test's time; the digits run
  # above trains on all 8.
  config = compare.config_from_args(
      ["--task", "text", "--methods", "allreduce,gtopk", "--steps", "4", "--eval-every", "2",
       "--devices", "2", "--out", str(tmp_path), "--no-progress"])
  report = compare.run(config)
  assert report["config"]["task"] == "text"
  for name in ("allreduce", "gtopk"):
    row = report["methods"][name]
    assert math.isfinite(row["final_loss"]) and row["bits_per_char"] > 0
    assert row["bits_per_char"] == pytest.approx(row["final_loss"] / math.log(2))
    assert row["bytes_per_step"] == row["bytes_per_step_formula"]
  assert report["methods"]["gtopk"]["bytes_per_step"] < report["methods"]["allreduce"]["bytes_per_step"]


def test_help_documents_every_flag():
  text = compare.parser().format_help()
  for flag in ("--quick", "--full", "--methods", "--task", "--steps", "--devices", "--mesh",
               "--layout", "--out", "--evaluate-on", "--bandwidth-gbit", "--latency-us"):
    assert flag in text


@pytest.mark.parametrize("argv", [["--methods", "zip"], ["--mesh", "2by4"], ["--steps", "0"],
                                  ["--quick", "--full"]])
def test_bad_flags_are_refused(argv):
  with pytest.raises(SystemExit):
    compare.config_from_args(argv)


def test_quick_is_the_default():
  assert compare.config_from_args([]).steps == compare.TASKS["digits"]["quick_steps"]
  assert compare.config_from_args(["--full"]).steps == compare.TASKS["digits"]["full_steps"]
  assert compare.config_from_args([]).methods == compare.ALL_METHODS


def _report(dense, others, dgc_density=0.001, dgc_ratio=400.0):
  methods = {"allreduce": {"final_accuracy": dense}}
  for name, accuracy in others.items():
    methods[name] = {"final_accuracy": accuracy, "compression_ratio": dgc_ratio,
                     "configuration": {"compressor": {"density": dgc_density}}}
  return {"config": {"evaluated_on": "test"}, "methods": methods}


def test_goals_are_checked():
  met = compare.check_goals(_report(0.97, {"gtopk": 0.955, "dgc": 0.96}))
  assert all(g["met"] for g in met) and len(met) == 5
  failed = {g["goal"] for g in compare.check_goals(
      _report(0.94, {"gtopk": 0.90, "dgc": 0.91}, dgc_density=0.01, dgc_ratio=120.0))
      if not g["met"]}
  assert len(failed) == 5


def test_dgc_warms_up_and_states_both_byte_figures(tmp_path):
  config = compare.config_from_args(
      ["--methods", "dgc", "--steps", "40", "--eval-every", "20", "--out", str(tmp_path),
       "--no-progress"])
  report = compare.run(config)
  row = report["methods"]["dgc"]
  compressor = row["configuration"]["compressor"]
  assert compressor["warmup_steps"] == 2  # 5% of 40 steps
  # Every leaf sparse, n = 71,754, P = 8: an all-gather of k f32 values and
  # one of k int32 indices, 7 * 8k bytes. Step 0 is in the 25% stage, step 1
  # in the 1.5625% one, the other 38 at density 0.001.
  n = report["config"]["num_params"]
  ks = [math.ceil(d * n) for d in (0.25, 0.015625)] + [math.ceil(0.001 * n)] * 38
  assert row["bytes_per_step"] == row["bytes_per_step_formula"] == 56 * ks[-1]
  assert row["bytes_per_step_run_average"] == row["bytes_per_step_run_average_formula"]
  assert row["bytes_per_step_run_average"] == pytest.approx(56 * sum(ks) / 40, rel=1e-12)
  assert row["bytes_by_kind"] == {"all-gather": row["bytes_per_step"]}
  assert row["compression_ratio"] == pytest.approx(4 * n / (8 * ks[-1]))
  table = (tmp_path / "compare.md").read_text()
  steady, average = row["bytes_per_step"], row["bytes_per_step_run_average"]
  assert f"| {steady:,.0f} ({average:,.0f} over the run) |" in table
  assert "over the first 2 of 40 steps" in table
  assert "without its warm-up" not in table and "warmup_steps=0" not in table


def test_fsdp_layout_reads_each_link_apart_and_matches_the_formula(tmp_path):
  config = compare.config_from_args(
      ["--methods", "allreduce,dgc", "--mesh", "2x4", "--layout", "fsdp", "--steps", "4",
       "--eval-every", "2", "--out", str(tmp_path), "--no-progress"])
  assert (config.layout, config.slow_axis, config.fast_axis) == ("fsdp", "x", "y")
  report = compare.run(config)
  names = {p.name for p in tmp_path.iterdir()}
  assert {"compare_fsdp.json", "compare_fsdp.md", "compare_fsdp_accuracy_vs_step.png"} <= names
  assert "compare.json" not in names and "compare.md" not in names
  assert json.loads((tmp_path / "compare_fsdp.json").read_text())["config"]["layout"] == "fsdp"
  params = models.digits_cnn(0).params
  # One device's row-block shard: 17,951 of the 71,754 parameters (padded).
  s = models.num_params(training.shard_shapes(params, 4))
  dense, dgc = report["methods"]["allreduce"], report["methods"]["dgc"]
  for name, row in report["methods"].items():
    # Fast link: the parameters' all-gather and the gradient's reduce-scatter,
    # 3/4 of the 4 padded blocks in f32 each; both axes: the 4-byte pmin, 2 * 7/8 * 4.
    assert row["fast_bytes_per_step"] == 2 * 3 / 4 * 4 * (4 * s)
    assert row["both_axes_bytes_per_step"] == 7
    compressor = registry.build(name, "x", **row["configuration"]["compressor"])
    for label, steps in (("", None), ("_run_average", 4)):
      formula = wire.tally(training.fsdp_transfers(compressor, params, {"x": 2, "y": 4},
                                                   "x", "y", steps=steps)).by_axes
      program = row["bytes_by_axes" + label]
      assert program["x+y"] == 7
      assert program == {"+".join(a): float(v) for a, v in formula.items()}, (name, label)
      assert row["formula_mismatch" + label] == {}
  # Slow link: dense's all-reduce of the shard over 2 nodes sends 4 s bytes;
  # DGC after its warm-up k = ceil(0.001 s) values and indices, 8 k.
  assert dense["slow_bytes_per_step"] == 4 * s
  assert dgc["slow_bytes_per_step"] == 8 * math.ceil(0.001 * s) < dense["slow_bytes_per_step"]
  assert dgc["slow_bytes_per_step"] < dgc["slow_bytes_per_step_run_average"]
  table = (tmp_path / "compare_fsdp.md").read_text()
  assert "| slow-link bytes/step (`x`) | vs dense | fast-link bytes/step (`y`) |" in table
  ratio = dgc["slow_bytes_per_step"] / dense["slow_bytes_per_step"]
  assert f"| {dgc['slow_bytes_per_step']:,.0f} (" in table and f"| {ratio:.3g}x |" in table
  assert "| NO" not in table.split("## Goals")[0]
  assert report["goals"][0]["met"] and "formula" in report["goals"][0]["goal"]


@pytest.mark.parametrize("argv", [["--layout", "fsdp"], ["--devices", "8", "--layout", "fsdp"]])
def test_fsdp_layout_without_a_mesh_is_refused(argv, capsys):
  with pytest.raises(SystemExit):
    compare.config_from_args(argv)
  assert "--layout fsdp needs a 2-axis mesh, e.g. --mesh 2x4" in capsys.readouterr().err
