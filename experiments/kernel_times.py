"""Where a compressor's step spends its time: milliseconds per kernel, against dense.

``experiments.bench_compression`` times each step whole and counts its
kernels and passes; this says which kernels the milliseconds go to. Each
compressor's step (one device, ResNet-50 or the transformer's shapes, as in
that table) runs ``--repeats`` times under ``jax.profiler.trace``; the
profile's events named after an instruction of the compiled program are its
kernels (XLA:CPU's thunks), summed over the threads that ran them (a kernel
split over two cores counts both: **thread-ms**) and divided by the steps.
A loop's or a conditional's row is the span of its own event, which may hold
the kernels it runs (listed too), so it is left out of the step's total.
``allreduce`` is always measured, in the same process, as the baseline; a
step's median wall milliseconds, taken before the profiled steps in rounds
that rotate the programs' order, are printed beside it. Every program holds
its state at once (a residual of the whole gradient for most: about 0.4 GB
each for the transformer), so name a few with ``--only`` there.

On CPU it shows what the passes alone do not: a kernel writing a buffer the
step allocates anew pays for its page faults (dense's copy of the gradient
into one buffer, and the all-reduce's copy out of it on one device, take
about as long as each other), and a kernel that hashes a counter per entry
(QSGD's rounding) costs more than its bytes.

  python -m experiments.kernel_times --model resnet50 --only qsgd,quantized \\
      --repeats 7 --top 12
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import statistics
import sys
import tempfile
from typing import Callable, NamedTuple

import jax

from experiments import bench_compression
from experiments import compute
from experiments import hlo_counts
from experiments import shapes
from jaxcomp import training


class Kernel(NamedTuple):
  """One kernel of a compiled step and its time.

  Attributes:
    name: the instruction's name in the compiled program.
    op: its opcode (``fusion``, ``all-reduce``, ``conditional``...).
    source: the JAX operation it comes from (its ``op_name``), or ``""``.
    thread_ms: milliseconds per step, summed over the threads that ran it.
  """

  name: str
  op: str
  source: str
  thread_ms: float


def kernel_ms(step: Callable[[], object], program: str, repeats: int) -> list[Kernel]:
  """The kernels of ``program`` (a compiled step's text) by the time ``repeats`` calls of
  ``step`` spent in them, the most first.

  Profile events whose name is no instruction of ``program`` (the Python
  calls, the executor's own spans, other programs) are left out. A kernel
  that did not show in the profile is not listed.
  """
  instructions = {i.name: i for body in hlo_counts.computations(program).values()
                  for i in body}
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(repeats):
        jax.block_until_ready(step())
    files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    if len(files) != 1:
      raise RuntimeError(f"expected one profile in {folder}, found {files}")
    profile = jax.profiler.ProfileData.from_file(files[0])
  total_ns = collections.Counter()
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in instructions:
          total_ns[event.name] += event.duration_ns
  return [Kernel(name, instructions[name].op, hlo_counts.source(instructions[name]),
                 ns / 1e6 / repeats)
          for name, ns in total_ns.most_common()]


def _work_ms(kernels: list[Kernel]) -> float:
  """Their thread-ms, less the spans of loops and conditionals (which hold their kernels')."""
  return sum(k.thread_ms for k in kernels if k.op not in hlo_counts.CONTROL)


def render(label: str, kernels: list[Kernel], step_ms: float, dense_ms: float,
           top: int) -> str:
  """``label``'s heaviest ``top`` kernels as a Markdown table, the rest summed in one row
  (a long ``source`` cut to its last 60 characters)."""
  shown, rest = kernels[:top], kernels[top:]
  cut = lambda text: text if len(text) <= 60 else "..." + text[-60:]  # noqa: E731
  rows = [f"| {k.name} | {k.op}{' (span)' if k.op in hlo_counts.CONTROL else ''} |"
          f" {cut(k.source)} | {k.thread_ms:.2f} |" for k in shown]
  if rest:
    rows.append(f"| {len(rest)} other kernels | | | {_work_ms(rest):.2f} |")
  total = _work_ms(kernels)
  return "\n".join([
      f"### {label}: {step_ms:.1f} ms a step, {step_ms / dense_ms:.2f}x dense"
      f" ({dense_ms:.1f} ms); kernels {total:.1f} thread-ms", "",
      "| kernel | op | from | thread-ms |", "|---|---|---|---|", *rows, ""])


def run(args, argv: list[str], log=print) -> str:
  """Every selected compressor's kernels, and ``allreduce``'s; the Markdown report
  (``argv``: the command's arguments, named in its header)."""
  table = bench_compression.selected(
      bench_compression.compressors(args.rank, args.density, args.bucket_cap_mb), args.only)
  labels = ["allreduce"] + [label for label in table if label != "allreduce"]
  grads = shapes.normal(bench_compression.MODELS[args.model](), jax.random.key(0))
  mesh = training.make_mesh(1)
  per_device = training.stack_per_device(grads, mesh, compute.AXIS)
  compiled = {label: compute.compile_update(table[label](), grads, mesh,
                                            per_device_grads=per_device)
              for label in labels}
  _, rounds = bench_compression.timed_rounds(
      {label: c.step for label, c in compiled.items()}, args.repeats)
  step_ms = {label: statistics.median(seconds) * 1e3 for label, seconds in rounds.items()}
  sections = [
      "# Milliseconds per kernel", "",
      f"Command: `python -m experiments.kernel_times {' '.join(argv)}`", "",
      f"Date {datetime.date.today().isoformat()}; jax {jax.__version__}; {args.model},"
      f" {shapes.num_params(grads):,} gradient elements, on one {jax.default_backend()}"
      f" device ({bench_compression.processor()}). thread-ms: a kernel's milliseconds per"
      " step in the profile, summed over the threads that ran it; a step's ms: the median"
      f" of {args.repeats} rounds of every program, the order rotated.", ""]
  log("\n".join(sections))
  for label in labels:
    kernels = kernel_ms(compiled[label].step, compiled[label].program, args.repeats)
    section = render(label, kernels, step_ms[label], step_ms["allreduce"], args.top)
    log(section, flush=True)
    sections.append(section)
  return "\n".join(sections)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.kernel_times",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=list(bench_compression.MODELS), default="resnet50")
  parser.add_argument("--only", default="",
                      help="comma-separated label prefixes of compressors (allreduce,"
                           " with buckets too, always runs)")
  parser.add_argument("--repeats", type=int, default=5,
                      help="steps timed, and steps profiled, per compressor")
  parser.add_argument("--top", type=int, default=12, help="kernels listed per compressor")
  bench_compression.add_setting_flags(parser)
  parser.add_argument("--bucket-cap-mb", type=float, default=0.0,
                      help="also each compressor with buckets of this many MiB (0: one bucket)")
  parser.add_argument("--out", default="", help="also write the Markdown report to this path")
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  for flag, value in (("--repeats", args.repeats), ("--top", args.top)):
    if value < 1:
      parser.error(f"{flag} must be >= 1")
  if args.bucket_cap_mb < 0:
    parser.error("--bucket-cap-mb must be >= 0 (0: one bucket only)")
  report = run(args, argv)
  if args.out:
    with open(args.out, "w") as f:
      f.write(report + "\n")


if __name__ == "__main__":
  main()
