"""experiments.bench_compression on tiny shapes, one device and --fast (no timing thresholds)."""

import itertools
import re
import statistics

import pytest

from experiments import bench_compression
from experiments import compute
from experiments import hlo_counts
from experiments import shapes
from jaxcomp import registry
from jaxcomp import training

ONLY = ("topk", "powersgd")  # with allreduce, always run: three rows keep the test short
REPEATS = 2
ARGV = ["--fast", "2", "--model", "tiny", "--repeats", str(REPEATS), "--density", "0.1",
        "--rank", "2", "--only", ",".join(ONLY)]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "hierarchical.md"
  bench_compression.main(ARGV + ["--out", str(out)])
  return out.read_text()


def _tables(report):
  """Each Markdown table of the report: (header, rows of cells)."""
  tables, block = [], []
  for line in report.splitlines() + [""]:
    if line.startswith("|"):
      block.append([c.strip() for c in line.strip("|").split("|")])
    elif block:
      tables.append((block[0], block[2:]))
      block = []
  return tables


def test_report_names_the_device_the_command_and_the_goal(report):
  assert "2 fake CPU devices" in report and "roughly" in report
  assert "`python -m experiments.bench_compression " + " ".join(ARGV) in report
  assert "## tiny: 875 gradient elements" in report
  assert "hier/flat <= 0.6:" in report and "How to read it" in report


def test_one_row_per_method_every_column(report):
  (step_header, steps), (header, rows) = _tables(report)
  assert tuple(step_header) == bench_compression.STEP_COLUMNS
  assert tuple(header) == bench_compression.COMPUTE_COLUMNS
  for table, columns in ((steps, step_header), (rows, header)):
    assert [r[0].split("(")[0] for r in table] == ["allreduce", *ONLY]
    assert all(len(r) == len(columns) for r in table)
  assert rows[0][header.index("<= 0.6")] == "n/a (baseline)"
  # Each device holds a residual of the whole gradient (875 elements) and a
  # count in the flat program, of its half only in the hierarchical one.
  for r in rows[1:]:
    flat, hier = (int(x.replace(",", "")) for x in
                  r[header.index("state elements/device flat / hier")].split(" / "))
    assert flat >= 876 and 0.45 * flat < hier < 0.7 * flat, r[0]
    # Compressing half the gradient moves fewer bytes, as read from the programs.
    flat, hier = (float(x) for x in r[header.index("passes flat / hier compute")].split(" / "))
    assert 0 < hier < flat, r[0]
    assert float(r[header.index("hier/flat passes")]) == pytest.approx(hier / flat, abs=0.01)


def test_differences_and_ratios_come_from_the_same_row(report):
  (step_header, steps), (header, rows) = _tables(report)
  col = {name: header.index(name) for name in header}
  half = 0.005  # every cell is rounded to 0.01
  for step, r in zip(steps, rows):
    assert step[0] == r[0]
    ms = {name[:-3]: float(step[step_header.index(name)])
          for name in step_header if name.endswith(" ms")}
    for part, (a, b) in (("flat compute ms", ("flat local", "local dense")),
                         ("hier compute ms", ("hier", "hier(dense)")),
                         ("half-n compute ms", ("half local", "half local dense")),
                         ("flat - dense ms", ("flat", "dense")),
                         ("hier - dense ms", ("hier", "dense"))):
      assert float(r[col[part]]) == pytest.approx(ms[a] - ms[b], abs=3 * half + 1e-9), (r[0], part)
    for ratio, part, whole in (("hier/flat", "hier compute ms", "flat compute ms"),
                               ("half-n/flat", "half-n compute ms", "flat compute ms"),
                               ("(hier - dense)/(flat - dense)", "hier - dense ms",
                                "flat - dense ms")):
      flat = float(r[col[whole]])
      if r[col[ratio]] == "n/a":
        assert flat <= half or r[0] == "allreduce", (r[0], ratio)
        continue
      assert r[0] != "allreduce"
      assert flat >= -half, (r[0], ratio)
      if flat - half <= 0:
        continue  # a whole within rounding of 0 (noise, under load) bounds no ratio
      part_ms = float(r[col[part]])
      corners = [p / f for p, f in itertools.product((part_ms - half, part_ms + half),
                                                     (flat - half, flat + half))]
      assert min(corners) - half <= float(r[col[ratio]]) <= max(corners) + half, (r[0], ratio)
    goal = r[col["<= 0.6"]]
    if r[0] != "allreduce" and r[col["hier/flat"]] != "n/a":
      shown = float(r[col["hier/flat"]])
      # The goal reads the unrounded ratio: a cell within rounding of 0.6 allows either.
      allowed = {"yes", "**no**"} if abs(shown - 0.6) <= half else {
          "yes" if shown <= 0.6 else "**no**"}
      assert goal in allowed, r[0]


def test_rows_hold_repeats_rounds_of_every_program():
  rows = bench_compression.hierarchical_rows(
      bench_compression.tiny(), 2, ["allreduce", "signsgd"], rank=2, density=0.1, repeats=3)
  assert [r.name for r in rows] == ["allreduce", "signsgd"]
  median_ms = lambda row, p: statistics.median(row.rounds[p]) * 1e3  # noqa: E731
  for row in rows:
    assert (set(row.rounds) == set(row.compile_s) == set(row.passes)
            == set(bench_compression.PROGRAMS))
    assert row.flat_compute_passes == row.passes["flat_local"] - row.passes["local_dense"]
    assert row.hier_compute_passes == row.passes["hier"] - row.passes["hier_dense"]
    assert set(row.state_elements) == {"flat", "hier"}
    assert all(len(times) == 3 and min(times) > 0 for times in row.rounds.values())
    assert row.flat_compute_ms == pytest.approx(
        median_ms(row, "flat_local") - median_ms(row, "local_dense"))
    assert row.hier_compute_ms == pytest.approx(
        median_ms(row, "hier") - median_ms(row, "hier_dense"))
    assert row.flat_over_dense_ms == pytest.approx(median_ms(row, "flat") - median_ms(row, "dense"))
    assert row.half_compute_ms == pytest.approx(
        median_ms(row, "half_local") - median_ms(row, "half_local_dense"))
    if row.flat_compute_ms > 0 and row.name != "allreduce":
      assert row.half_ratio == pytest.approx(row.half_compute_ms / row.flat_compute_ms)
      assert row.ratio == pytest.approx(row.hier_compute_ms / row.flat_compute_ms)
      assert row.meets_goal is (None if row.name == "allreduce" else row.ratio <= 0.6)
    else:
      assert row.ratio is None and row.meets_goal is None
  # Each row times the dense programs again in its own rounds.
  assert rows[0].rounds["dense"] is not rows[1].rounds["dense"]


def test_default_rows_are_the_registry():
  assert bench_compression.hierarchical_names() == list(registry.names())
  assert bench_compression.hierarchical_names("top,power") == ["allreduce", "topk", "powersgd"]
  assert "tiny" not in bench_compression.ALL_MODELS
  config = bench_compression.settings("powersgd", rank=3, density=0.5)
  assert config == registry.configuration("powersgd", rank=3)


def test_bad_arguments_are_refused():
  for argv in (["--fast", "1"], ["--fast", "2", "--repeats", "0"],
               ["--fast", "2", "--save-hlo", "hlo"]):
    with pytest.raises(SystemExit):
      bench_compression.main(argv)


def test_one_device_table_reports_kernels_and_passes_from_the_program(tmp_path):
  out = tmp_path / "single.md"
  argv = ["--model", "tiny", "--repeats", "1", "--density", "0.1", "--only", "topk,signsgd",
          "--bucket-cap-mb", "0", "--out", str(out), "--save-hlo", str(tmp_path / "hlo")]
  bench_compression.main(argv)
  report = out.read_text()
  # Each row's program is saved, named for its model and label, and its counts
  # are those of the table.
  saved = {p.name: p.read_text() for p in (tmp_path / "hlo").iterdir()}
  assert set(saved) == {"tiny_allreduce.hlo.txt", "tiny_topk_density_0.1.hlo.txt",
                        "tiny_signsgd.hlo.txt", "tiny_signsgd_majority_vote_True.hlo.txt"}
  assert "one CPU device" in report and "experiments.hlo_counts" in report
  ((header, rows),) = _tables(report)
  assert tuple(header) == bench_compression.SINGLE_COLUMNS
  by_label = {row[0]: dict(zip(header, row)) for row in rows}
  assert set(by_label) == {"allreduce", "topk(density=0.1)", "signsgd",
                           "signsgd(majority_vote=True)"}
  # One device: dense concatenates, all-reduces (a copy) and splits the gradient.
  assert by_label["allreduce"]["passes"] == "6.0"
  assert by_label["allreduce"]["x dense"] == "1.00"
  # Its outputs at least are new buffers (the gradient is not donated), and at
  # most the concatenation and the all-reduce's result besides.
  assert 1.0 <= float(by_label["allreduce"]["fresh"]) <= 3.0
  for row in by_label.values():
    assert int(row["kernels"]) >= 3 and float(row["passes"]) >= 2.0
    assert float(row["fresh"]) >= 1.0
  topk = hlo_counts.count(saved["tiny_topk_density_0.1.hlo.txt"], 875)
  assert str(topk.kernels) == by_label["topk(density=0.1)"]["kernels"]


@pytest.mark.parametrize("tunables, note", [
    (None, "glibc malloc's default pages"),
    ("glibc.malloc.arena_max=2", "glibc malloc's default pages"),
    ("glibc.malloc.hugetlb=1", "`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`"),
    ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0",
     "`GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0`"),
])
def test_the_device_note_says_how_malloc_backs_memory(monkeypatch, tunables, note):
  if tunables is None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  else:
    monkeypatch.setenv("GLIBC_TUNABLES", tunables)
  assert f"), {note}, the exact top-k " in bench_compression._device_note()


@pytest.mark.parametrize("reason, note", [
    (None, "the exact top-k as jaxcomp's native custom call"),
    ("JAXCOMP_NATIVE=0", "the exact top-k in JAX (no native custom call: JAXCOMP_NATIVE=0)"),
])
def test_the_device_note_says_how_the_exact_top_k_ran(monkeypatch, reason, note):
  monkeypatch.setattr(bench_compression.selection, "native_unavailable_reason", lambda: reason)
  assert bench_compression._device_note().endswith(note)


@pytest.mark.parametrize("flags, xla_flags, name", [
    ("fpu sse2 avx avx2 fma", "", "AMD EPYC, AVX2"),
    ("fpu avx avx2 avx512f avx512bw", "", "AMD EPYC, AVX-512"),
    ("fpu avx avx2 avx512f", "--xla_cpu_max_isa=AVX2", "AMD EPYC, AVX-512, XLA capped at AVX2"),
    ("fpu sse2", "", "AMD EPYC, no AVX"),
])
def test_the_device_note_names_the_cpu_and_its_vector_instructions(monkeypatch, flags,
                                                                   xla_flags, name):
  monkeypatch.setenv("XLA_FLAGS", xla_flags)
  cpuinfo = f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
  assert bench_compression.processor(cpuinfo) == name
  # A CPU that names no model and no x86 flags (an Arm's /proc/cpuinfo) is not said to lack AVX.
  monkeypatch.setenv("XLA_FLAGS", "")
  assert bench_compression.processor("processor\t: 0\nFeatures\t: fp asimd\n") == "CPU"


def test_a_method_with_forms_has_a_row_per_form(tmp_path):
  out = tmp_path / "forms.md"
  bench_compression.main(["--model", "tiny", "--repeats", "1", "--rank", "2", "--only",
                          "acpsgd", "--bucket-cap-mb", "0", "--out", str(out)])
  ((header, rows),) = _tables(out.read_text())
  labels = [row[0] for row in rows]
  assert labels == ["allreduce", "acpsgd(rank=2)", "acpsgd(rank=2) P step",
                    "acpsgd(rank=2) Q step"]


def test_a_form_s_program_holds_its_exchange_outside_any_conditional():
  """What `make_step` runs: the form picked on the host, its all-reduce in the entry
  computation; the program of both forms holds each in a branch of a conditional."""
  grads = shapes.zeros(bench_compression.tiny())
  mesh = training.make_mesh(1)
  build = lambda: registry.build("acpsgd", compute.AXIS, rank=2)  # noqa: E731

  def all_reduces(tx):
    """``(all-reduces in the program, in its entry computation)``."""
    parsed = hlo_counts.computations(compute.compile_update(tx, grads, mesh).program)
    counts = {name: sum(1 for i in instructions if i.op in ("all-reduce", "all-reduce-start"))
              for name, instructions in parsed.items()}
    return sum(counts.values()), counts["ENTRY"]

  assert all_reduces(bench_compression.in_form(build, 0)) == (1, 1)
  assert all_reduces(bench_compression.in_form(build, 1)) == (1, 1)
  assert all_reduces(build()) == (2, 0)


def test_buckets_add_a_row_per_method(tmp_path):
  out = tmp_path / "buckets.md"
  bench_compression.main(["--model", "tiny", "--repeats", "1", "--density", "0.1", "--only",
                          "gtopk", "--bucket-cap-mb", "0.001", "--out", str(out)])
  ((header, rows),) = _tables(out.read_text())
  by_label = {row[0]: dict(zip(header, row)) for row in rows}
  assert set(by_label) == {"allreduce", "gtopk(density=0.1)", "allreduce(bucket_cap_mb=0.001)",
                           "gtopk(density=0.1, bucket_cap_mb=0.001)"}
  # Each bucket is its own exchange: more kernels than one bucket, the same bytes' order.
  assert (int(by_label["gtopk(density=0.1, bucket_cap_mb=0.001)"]["kernels"])
          > int(by_label["gtopk(density=0.1)"]["kernels"]))
  # The rows with buckets have rounds of their own, and dense again in them for their ratios.
  (dense_ms,) = re.findall(r"with `allreduce` \(([0-9.]+) ms there\)", out.read_text())
  dense_ms, half_ms = float(dense_ms), 0.05  # milliseconds are shown to 0.1, ratios to 0.01
  for label in ("allreduce(bucket_cap_mb=0.001)", "gtopk(density=0.1, bucket_cap_mb=0.001)"):
    row = by_label[label]
    ms, ratio = float(row["ms/step"]), float(row["x dense"])
    assert ratio >= (ms - half_ms) / (dense_ms + half_ms) - 0.005, label
    if dense_ms > half_ms:  # else the rounded dense bounds no ratio from above
      assert ratio <= (ms + half_ms) / (dense_ms - half_ms) + 0.005, label
  assert by_label["allreduce"]["x dense"] == "1.00"


def test_the_rows_of_one_bucket_and_with_buckets_are_timed_apart_each_with_dense():
  labels = ["allreduce", "topk", "allreduce(bucket_cap_mb=25)", "topk(bucket_cap_mb=25)",
            "acpsgd(bucket_cap_mb=25) P step"]
  assert bench_compression.single_phases(labels) == [
      ["allreduce", "topk"],
      ["allreduce", "allreduce(bucket_cap_mb=25)", "topk(bucket_cap_mb=25)",
       "acpsgd(bucket_cap_mb=25) P step"]]
  assert bench_compression.single_phases(["allreduce", "topk"]) == [["allreduce", "topk"]]
  with pytest.raises(SystemExit):
    bench_compression.main(["--bucket-cap-mb", "-1"])
