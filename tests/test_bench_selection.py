"""experiments.bench_selection on a small vector (no timing thresholds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_selection


def _vector(n, seed):
  """Entries in {-2, ..., 2} (ties in every chunk) with NaN and infinities."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-2, 3, size=n).astype(np.float32)
  x[rng.integers(0, n, 20)] = np.nan
  x[rng.integers(0, n, 20)] = -np.inf
  return jnp.asarray(x)


@pytest.mark.parametrize("chunk, k", [(1024, 3), (256, 1), (1000, 2)])  # blocks, argmax, top_k
def test_per_chunk_routes_report_the_positions_of_the_baseline(chunk, k):
  rows = bench_selection.per_chunk_rows(_vector(10_000, chunk + k), chunk, k, repeats=1)
  assert [name for name, *_ in rows][1] == "topk_per_row (this backend)"
  assert rows[0][0] == ("f32 argmax" if k == 1 else "lax.top_k per row")
  assert all(same for *_, same in rows)
  assert all(wall > 0 and cpu >= 0 for _, wall, cpu, _ in rows)


def test_main_prints_both_tables(capsys):
  bench_selection.main(["--size", "20000", "--density", "0.001", "--repeats", "1",
                        "--chunk", "4096"])
  out = capsys.readouterr().out
  assert "| lax.top_k " in out and "| exact_topk " in out
  fallback = [line for line in out.splitlines() if "| exact_topk, fallback " in line]
  assert len(fallback) == 1 and fallback[0].rstrip(" |").endswith("1.0000")
  lines = [line for line in out.splitlines() if "topk_per_row (this backend)" in line]
  assert len(lines) == 3  # SparseLoCo's chunks, then DeMo's at k = 1 and at its default 2
  assert "5 x 4096, k = 5" in lines[0] and "313 x 64, k = 1" in lines[1]
  assert "313 x 64, k = 2" in lines[2]
  assert all(line.rstrip(" |").endswith("yes") for line in lines)
  assert jax.devices()[0].platform in out


def test_small_buckets_time_both_routes_and_the_threshold_s_recall(capsys, monkeypatch):
  tunings = []
  sampled_topk = bench_selection.selection.sampled_topk

  def spy(*args):
    tunings.append(args[5])
    return sampled_topk(*args)

  monkeypatch.setattr(bench_selection.selection, "sampled_topk", spy)
  rows = bench_selection.small_bucket_rows([1024], [0.25, 0.01], 0.01, repeats=1)
  # The threshold's row runs the threshold, below sampled_min_size too.
  assert len(tunings) == 2
  assert all(t.sampled and t.sampled_min_size is None for t in tunings)
  assert [(n, k, name) for n, k, name, *_ in rows] == [
      (1024, 256, "lax.top_k"), (1024, 256, "sampled threshold"),
      (1024, 11, "lax.top_k"), (1024, 11, "sampled threshold")]
  assert all(seconds > 0 and wall > 0 and 0 <= recall <= 1
             for *_, seconds, wall, recall in rows)
  assert [recall for _, _, name, *_, recall in rows if name == "lax.top_k"] == [1.0, 1.0]
  # The flag prints the table alone (two sizes here: every size takes about 20 s).
  monkeypatch.setattr(bench_selection, "SMALL_SIZES", (512, 1024))
  monkeypatch.setattr(bench_selection, "SMALL_DENSITIES", (0.01,))
  bench_selection.main(["--small-buckets", "--repeats", "1"])
  out = capsys.readouterr().out
  assert out.count("| sampled threshold |") == 2 and out.count("| lax.top_k ") == 2
  assert "| exact_topk " not in out
