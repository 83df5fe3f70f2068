"""`python -m experiments.kernel_times`: each kernel of a compiled step by its profiled time."""

import jax
import pytest

from experiments import bench_compression
from experiments import compute
from experiments import hlo_counts
from experiments import kernel_times
from experiments import shapes
from jaxcomp import registry
from jaxcomp import training


def _compiled(name):
  grads = shapes.normal(bench_compression.tiny(), jax.random.key(0))
  return compute.compile_update(registry.build(name, compute.AXIS), grads,
                                training.make_mesh(1))


def test_the_kernels_are_the_program_s_instructions_the_all_reduce_among_them():
  compiled = _compiled("allreduce")
  kernels = kernel_times.kernel_ms(compiled.step, compiled.program, repeats=2)
  instructions = {i.name: i for body in hlo_counts.computations(compiled.program).values()
                  for i in body}
  assert kernels and all(k.name in instructions for k in kernels)
  assert all(k.op == instructions[k.name].op for k in kernels)
  assert "all-reduce" in {k.op for k in kernels}
  assert all(k.thread_ms > 0 for k in kernels)
  assert [k.thread_ms for k in kernels] == sorted((k.thread_ms for k in kernels), reverse=True)


def test_events_that_are_no_instruction_of_the_program_are_left_out():
  """The profile also holds the Python calls and the executor's own spans: none is a kernel."""
  compiled = _compiled("allreduce")
  other = "ENTRY %main () -> f32[] {\n  ROOT %nothing.1 = f32[] constant(0)\n}\n"
  assert [i.name for i in hlo_counts.computations(other)["ENTRY"]] == ["nothing.1"]
  assert kernel_times.kernel_ms(compiled.step, other, repeats=1) == []


def test_the_table_lists_the_heaviest_and_sums_the_rest_without_control_flow_spans():
  kernels = [kernel_times.Kernel(f"k{i}", "fusion", "jit(update)/add", float(6 - i))
             for i in range(5)]
  kernels.insert(1, kernel_times.Kernel("cond.1", "conditional", "x" * 70, 5.5))
  kernels.append(kernel_times.Kernel("while.2", "while", "", 0.5))
  text = kernel_times.render("qsgd(levels=8)", kernels, step_ms=30.0, dense_ms=20.0, top=3)
  # 6 + 5 + 4 + 3 + 2: the conditional's and the loop's spans hold their kernels' time
  assert text.startswith("### qsgd(levels=8): 30.0 ms a step, 1.50x dense (20.0 ms);"
                         " kernels 20.0 thread-ms")
  assert "| k0 | fusion | jit(update)/add | 6.00 |" in text and "| k2 |" not in text
  assert f"| cond.1 | conditional (span) | ...{'x' * 60} | 5.50 |" in text
  # four rows: k2, k3 and k4 (9 thread-ms), and the loop's span, left out of the sum
  assert "| 4 other kernels | | | 9.00 |" in text


def test_main_writes_dense_first_then_each_chosen_compressor(tmp_path):
  out = tmp_path / "kernels.md"
  kernel_times.main(["--model", "tiny", "--only", "signsgd", "--repeats", "1", "--top", "2",
                     "--out", str(out)])
  text = out.read_text()
  assert text.startswith("# Milliseconds per kernel\n\nCommand: `python -m"
                         " experiments.kernel_times --model tiny --only signsgd --repeats 1")
  sections = [line.split(":")[0] for line in text.splitlines() if line.startswith("### ")]
  assert sections == ["### allreduce", "### signsgd", "### signsgd(majority_vote=True)"]
  assert "other kernels" in text


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--top", "0"], ["--bucket-cap-mb", "-1"],
                                  ["--model", "vgg"]])
def test_bad_flags_are_refused(argv):
  with pytest.raises(SystemExit):
    kernel_times.main(argv)
