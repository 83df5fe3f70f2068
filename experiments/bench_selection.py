"""Selecting the top 0.1% of a large gradient on CPU: exact, approximate, sampled.

Times (median of ``--repeats`` runs after one warm-up run, each jitted; wall
clock and this process's CPU time) with the speed-up over ``lax.top_k`` of
the same vector, measured in the same run, and recall against it:

* ``lax.top_k``: exact, the baseline;
* ``lax.approx_max_k``: XLA's approximate top-k (exact on CPU);
* ``sampled threshold``: DGC's selection,
  :func:`jaxcomp.selection.sampled_topk` (threshold from a sample, one-pass
  compaction, exact top-k among the candidates, a radix-search fallback);
* ``exact_topk``: :func:`jaxcomp.selection.exact_topk`, the same sampled
  threshold with an exact radix-search fallback whenever fewer than k entries
  pass it or too many for the candidates' buffer: always the entries of
  ``lax.top_k`` (what topk and gtopk use on large buckets);
* ``exact_topk, fallback``: the same on a vector of equal magnitudes, which
  always takes the fallback, against ``lax.top_k`` of that vector.

With ``--small-buckets`` it prints one table instead: DGC's sampled
threshold against ``lax.top_k`` on small buckets, compile seconds too, at
DGC's densities (its warm-up's 25% and 6.25% included), where
:attr:`jaxcomp.selection.Tuning.sampled_min_size` draws the line.

A second table times the per-chunk selection of SparseLoCo (chunks of
``--chunk`` entries, ``ceil(density chunk)`` of each) and of DeMo (chunks of
64: one of each at density 0.001, two at its default 1/32) against the
per-row ``lax.top_k`` (and, for one per row, the f32 argmax) that
:func:`jaxcomp.selection.topk_per_row` replaces on CPU, with whether the
positions are the same.

Usage::

  python -m experiments.bench_selection --size 25600000 --repeats 5
  python -m experiments.bench_selection --small-buckets --repeats 21
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxcomp import selection


def _median_seconds(fn, args, repeats: int) -> tuple[float, float]:
  """Median wall and process-CPU seconds of ``fn(*args)`` after one warm-up run.

  CPU time (all threads of this process) is less disturbed than wall time
  when other jobs share the cores.
  """
  jax.block_until_ready(fn(*args))
  wall, cpu = [], []
  for _ in range(repeats):
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return statistics.median(wall), statistics.median(cpu)


def _recall(indices, exact: np.ndarray) -> float:
  got = np.asarray(indices)
  return len(np.intersect1d(got, exact)) / len(exact)


def _magnitude(rows):
  """``|rows|`` with NaN ranked as ``inf`` (``topk_per_row``'s order), as f32."""
  magnitude = jnp.abs(rows)
  return jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude)


def per_chunk_rows(x: jax.Array, chunk: int, k: int, repeats: int) -> list:
  """``[(route, wall s, cpu s, same positions as the first)]`` for the ``k`` largest
  magnitudes of each chunk of ``x`` (zero-padded to whole chunks)."""
  count = -(-x.shape[0] // chunk)
  rows = jnp.pad(x, (0, count * chunk - x.shape[0])).reshape(count, chunk)
  if k == 1:
    baseline = ("f32 argmax", lambda r: jnp.argmax(_magnitude(r), axis=1, keepdims=True))
  else:
    baseline = ("lax.top_k per row", lambda r: lax.top_k(_magnitude(r), k)[1])
  routes = [baseline, ("topk_per_row (this backend)", lambda r: selection.topk_per_row(r, k)[1])]
  results, first = [], None
  for name, fn in routes:
    fn = jax.jit(fn)
    positions = np.asarray(fn(rows))
    first = positions if first is None else first
    wall, cpu = _median_seconds(fn, (rows,), repeats)
    results.append((name, wall, cpu, bool(np.array_equal(positions, first))))
  return results


# Sizes and densities of the small-bucket table: DGC's warm-up stages and targets.
SMALL_SIZES = (1024, 2048, 4096, 8192, 16384)
SMALL_DENSITIES = (0.25, 0.0625, 0.01, 0.001)


def small_bucket_rows(sizes, densities, sample_ratio: float, repeats: int) -> list:
  """``[(n, k, route, compile s, wall s, recall)]``: ``lax.top_k``, then DGC's sampled
  threshold (at every size: ``Tuning(sampled_min_size=None)``), on ``n`` Gaussian
  entries, ``k = ceil(density n)``; recall against ``lax.top_k``."""
  every_size = selection.Tuning(sampled_min_size=None)
  results = []
  for n in sizes:
    x = jax.random.normal(jax.random.key(n), (n,), jnp.float32)
    key = jax.random.key(n + 1)
    for density in densities:
      k = max(1, math.ceil(density * n))
      routes = [
          ("lax.top_k", lambda x, key, k=k: selection.select_topk(x, k)[1]),
          ("sampled threshold", lambda x, key, k=k: selection.sampled_topk(
              x, k, k, key, sample_ratio, every_size)[1]),
      ]
      exact = None
      for name, fn in routes:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(x, key).compile()
        seconds = time.perf_counter() - start
        indices = np.asarray(compiled(x, key))
        exact = indices if exact is None else exact
        wall, _ = _median_seconds(compiled, (x, key), repeats)
        results.append((n, k, name, seconds, wall, _recall(indices, exact)))
  return results


def print_small_buckets(sizes, densities, sample_ratio: float, repeats: int) -> None:
  """Prints :func:`small_bucket_rows` as a table, each route's speed-up over the threshold."""
  rows = small_bucket_rows(sizes, densities, sample_ratio, repeats)
  print(f"small buckets, sample ratio {sample_ratio:g}, median of {repeats},"
        f" {jax.devices()[0].platform}")
  print(f"| {'entries':>7} | {'k':>5} | {'route':<17} | {'compile s':>9} | {'wall ms':>8} |"
        f" {'speed-up':>8} | {'recall':>6} |")
  print(f"|{'-' * 9}|{'-' * 7}|{'-' * 19}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
  threshold_wall = {(n, k): wall for n, k, name, _, wall, _ in rows
                    if name == "sampled threshold"}
  for n, k, name, seconds, wall, recall in rows:
    print(f"| {n:>7} | {k:>5} | {name:<17} | {seconds:>9.2f} | {wall * 1e3:>8.3f} |"
          f" {threshold_wall[n, k] / wall:>7.2f}x | {recall:>6.4f} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", type=int, default=25_600_000, help="floats in the vector")
  parser.add_argument("--density", type=float, default=0.001, help="share selected")
  parser.add_argument("--sample-ratio", type=float, default=0.01,
                      help="share sampled for the threshold")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chunk", type=int, default=4096,
                      help="entries per chunk of the per-chunk table (SparseLoCo's)")
  parser.add_argument("--small-buckets", action="store_true",
                      help="only the table of small buckets (DGC's sampled threshold"
                           " against lax.top_k), at --sample-ratio")
  args = parser.parse_args(argv)
  if args.small_buckets:
    print_small_buckets(SMALL_SIZES, SMALL_DENSITIES, args.sample_ratio, args.repeats)
    return

  n = args.size
  k = max(1, math.ceil(args.density * n))
  x = jax.random.normal(jax.random.key(args.seed), (n,), jnp.float32)
  key = jax.random.key(args.seed + 1)

  exact_fn = jax.jit(lambda x: lax.top_k(jnp.abs(x), k)[1])
  approx_fn = jax.jit(lambda x: lax.approx_max_k(jnp.abs(x), k)[1])
  # The threshold at every size: below Tuning.sampled_min_size it would be lax.top_k.
  every_size = selection.Tuning(sampled_min_size=None)
  sampled_fn = jax.jit(
      lambda x, key: selection.sampled_topk(x, k, k, key, args.sample_ratio, every_size)[1]
  )

  exact_topk_fn = jax.jit(lambda x: selection.exact_topk(x, k)[1])

  # Every magnitude 1: the sample never separates k entries, the fallback runs.
  equal = jnp.where(x < 0, -1.0, 1.0)
  # Each row with the lax.top_k row of its vector, its speed-ups' baseline.
  rows = [
      ("lax.top_k", exact_fn, (x,), 0),
      ("lax.approx_max_k", approx_fn, (x,), 0),
      (f"sampled threshold ({args.sample_ratio:g})", sampled_fn, (x, key), 0),
      ("exact_topk", exact_topk_fn, (x,), 0),
      ("lax.top_k, equal magnitudes", exact_fn, (equal,), 4),
      ("exact_topk, fallback", exact_topk_fn, (equal,), 4),
  ]
  # The exact indices of each vector, once, for every row of it.
  exact = {base: np.asarray(exact_fn(fn_args[0])) for _, fn, fn_args, base in rows
           if fn is exact_fn}
  results = []
  for name, fn, fn_args, base in rows:
    wall, cpu = _median_seconds(fn, fn_args, args.repeats)
    results.append((name, wall, cpu, _recall(fn(*fn_args), exact[base]), base))
  print(f"top {k} of {n} f32 (density {args.density:g}), median of {args.repeats},"
        f" {jax.devices()[0].platform}")
  print(f"| {'method':<28} | {'wall ms':>8} | {'speed-up':>8} | {'cpu ms':>8} |"
        f" {'speed-up':>8} | {'recall':>6} |")
  print(f"|{'-' * 30}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
  for name, wall, cpu, recall, base in results:
    base_wall, base_cpu = results[base][1], results[base][2]
    print(f"| {name:<28} | {wall * 1e3:>8.2f} | {base_wall / wall:>7.1f}x |"
          f" {cpu * 1e3:>8.2f} | {base_cpu / cpu:>7.1f}x | {recall:>6.4f} |")

  print()
  print(f"per chunk, median of {args.repeats}")
  print(f"| {'chunks x entries, k':<22} | {'route':<28} | {'wall ms':>8} | {'speed-up':>8} |"
        f" {'cpu ms':>8} | {'speed-up':>8} | same positions |")
  print(f"|{'-' * 24}|{'-' * 30}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 16}|")
  for chunk, k in ((args.chunk, max(1, math.ceil(args.density * args.chunk))), (64, 1),
                   (64, 2)):
    chunk = min(chunk, n)
    shape = f"{-(-n // chunk)} x {chunk}, k = {k}"
    chunk_rows = per_chunk_rows(x, chunk, k, args.repeats)
    base_wall, base_cpu = chunk_rows[0][1], chunk_rows[0][2]
    for name, wall, cpu, same in chunk_rows:
      print(f"| {shape:<22} | {name:<28} | {wall * 1e3:>8.2f} | {base_wall / wall:>7.1f}x |"
            f" {cpu * 1e3:>8.2f} | {base_cpu / cpu:>7.1f}x | {'yes' if same else 'NO':<14} |")


if __name__ == "__main__":
  main()
