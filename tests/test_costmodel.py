"""The cost model prices the wire formulas, and ranks the methods as the papers do."""

from fractions import Fraction

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import pytest

from experiments import shapes
from jaxcomp import base
from jaxcomp import costmodel
from jaxcomp import training
from jaxcomp import wire

SMALL = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32),
         "b": jax.ShapeDtypeStruct((32,), jnp.float32)}
ALL = tuple(costmodel.METHODS)


def _byte_seconds(nbytes, bandwidth_gbit):
  return float(nbytes) * 8 / (bandwidth_gbit * 1e9)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("num_devices", [8, 32, (2, 4), (4, 8)], ids=str)
def test_byte_term_is_the_wire_formula(name, num_devices):
  axis = "data" if isinstance(num_devices, int) else ("x", "y")
  tx = costmodel.build(name, axis)
  cost = tx.wire_bytes(SMALL, num_devices)
  expected = wire.expected_bytes(tx, SMALL, num_devices).total
  assert expected > 0
  assert costmodel.exchange_time(cost, 2.5, 0.0) == pytest.approx(
      _byte_seconds(expected, 2.5), rel=1e-12
  )


@pytest.mark.parametrize("name", ["allreduce", "cast"])
@pytest.mark.parametrize("shape", [8, (2, 4)], ids=str)
def test_byte_term_is_what_the_compiled_program_sends(name, shape):
  axis = "data" if isinstance(shape, int) else ("x", "y")
  mesh = training.make_mesh(shape, (axis,) if isinstance(axis, str) else axis)
  tx = costmodel.build(name, axis)
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
  state = training.init_state(tx, params, mesh, axis)
  spec = training._spec(axis)
  update = jax.jit(jax.shard_map(
      lambda g, s: tx.update(g, jax.tree.map(lambda x: x[0], s))[0], mesh=mesh,
      in_specs=(jax.sharding.PartitionSpec(), spec), out_specs=jax.sharding.PartitionSpec(),
      check_vma=False,
  ))
  compiled = update.lower(params, state).compile()
  measured = wire.collective_bytes(compiled).total
  cost = tx.wire_bytes(params, shape)
  assert costmodel.exchange_time(cost, 1.0, 0.0) == pytest.approx(
      _byte_seconds(measured, 1.0), rel=1e-12
  )


@pytest.mark.parametrize(
    "kind,group,expected",
    [("all-reduce", 8, 14), ("reduce-scatter", 8, 7), ("all-gather", 8, 7),
     ("all-to-all", 8, 7), ("collective-permute", 1, 1), ("all-reduce", 1, 0)],
)
def test_ring_steps(kind, group, expected):
  assert costmodel.steps(kind, group) == expected
  cost = (base.Transfer(kind, group, Fraction(0)),)
  assert costmodel.exchange_time(cost, 1.0, 10.0) == pytest.approx(expected * 10e-6)


def test_weight_scales_both_terms():
  full = (base.Transfer("all-reduce", 4, Fraction(1000)),)
  half = (base.Transfer("all-reduce", 4, Fraction(1000), Fraction(1, 2)),)
  assert costmodel.exchange_time(half, 1.0, 7.0) == pytest.approx(
      costmodel.exchange_time(full, 1.0, 7.0) / 2
  )


@hypothesis.given(
    rows=st.sampled_from([2, 4, 8, 32, 64]), cols=st.sampled_from([2, 4, 8, 32, 64]),
)
def test_torus_latency_grows_with_rows_plus_cols(rows, cols):
  flat = costmodel.build("allreduce", "data").wire_bytes(SMALL, rows * cols)
  torus = costmodel.build("allreduce", ("x", "y")).wire_bytes(SMALL, (rows, cols))
  latency_only = lambda cost: (
      costmodel.exchange_time(cost, 1.0, 1.0) - costmodel.exchange_time(cost, 1.0, 0.0)
  )
  assert latency_only(flat) == pytest.approx(2 * (rows * cols - 1) * 1e-6)
  assert latency_only(torus) == pytest.approx((2 * (rows - 1) + 2 * (cols - 1)) * 1e-6)


def test_predict_adds_compute():
  tx = costmodel.build("allreduce", "data")
  exchange = costmodel.exchange_time(tx.wire_bytes(SMALL, 16), 10.0, 5.0)
  assert costmodel.predict(tx, SMALL, 16, 10.0, 5.0) == pytest.approx(exchange)
  assert costmodel.predict(tx, SMALL, 16, 10.0, 5.0, compute_s=0.25) == pytest.approx(
      exchange + 0.25
  )


def test_recommend_ranks_gtopk_above_dense_on_slow_ethernet():
  resnet = shapes.resnet50()
  ranked = costmodel.recommend(resnet, 32, 1.0, 50.0)
  names = [r.name for r in ranked]
  assert sorted(names) == sorted(ALL)
  assert names.index("gtopk") < names.index("allreduce")
  assert [r.seconds for r in ranked] == sorted(r.seconds for r in ranked)
  gtopk = ranked[names.index("gtopk")]
  assert gtopk.config == {"density": 0.001}
  # Dense S-SGD at 1 Gbit/s: 2 * 31/32 * 4n bytes, 1.58 s for ResNet-50.
  dense = ranked[names.index("allreduce")]
  n = shapes.num_params(resnet)
  assert dense.seconds == pytest.approx(2 * 31 / 32 * 4 * n * 8 / 1e9 + 62 * 50e-6)


def test_recommend_on_the_torus_and_with_given_compute():
  ranked = costmodel.recommend(
      SMALL, (4, 8), 100.0, 1.0, methods=["allreduce", "cast"],
      compute_s={"cast": 1.0}, base_compute_s=0.5,
  )
  assert [r.name for r in ranked] == ["allreduce", "cast"]
  assert ranked[1].seconds > 1.5


def test_measure_compute_times_one_update():
  seconds = costmodel.measure_compute(costmodel.build("cast", "data"), SMALL, repeats=2)
  assert 0 < seconds < 5


@pytest.mark.parametrize(
    "kwargs,match",
    [({"bandwidth_gbit": 0.0}, "`bandwidth_gbit` must be in"),
     ({"bandwidth_gbit": float("nan")}, "`bandwidth_gbit` must be in"),
     ({"latency_us": -1.0}, "`latency_us` must be in")],
)
def test_network_is_validated(kwargs, match):
  cost = costmodel.build("allreduce", "data").wire_bytes(SMALL, 8)
  args = {"bandwidth_gbit": 1.0, "latency_us": 1.0, **kwargs}
  with pytest.raises(ValueError, match=match):
    costmodel.exchange_time(cost, **args)


def test_names_are_validated():
  with pytest.raises(ValueError, match="`name` must be one of"):
    costmodel.build("zip", "data")
  with pytest.raises(ValueError, match="unknown methods"):
    costmodel.recommend(SMALL, 8, 1.0, 1.0, methods=["zip"])
  with pytest.raises(ValueError, match="`kind` must be one of"):
    costmodel.steps("broadcast", 4)
  with pytest.raises(TypeError, match="`tx` must be a jaxcomp compressor"):
    costmodel.predict(object(), SMALL, 8, 1.0, 1.0)
  with pytest.raises(ValueError, match="`compute_s` must be in"):
    costmodel.predict(costmodel.build("allreduce", "data"), SMALL, 8, 1.0, 1.0, compute_s=-1)


def test_scaling_tables_have_the_seeds_shapes():
  from experiments import scaling

  args = scaling.parser().parse_args([])
  args.compute_s = {"resnet50": args.resnet50_compute_s,
                    "transformer": args.transformer_compute_s}
  for rows in scaling.sparse_table(args).values():
    d, t, g = (rows[32][name]["efficiency"] for name in ("allreduce", "topk", "gtopk"))
    assert 2.7 <= g / d <= 12  # gTop-k paper: 2.7-12x over S-SGD, 32 workers, 1 GbE
    assert 1.0 < g / t < 1.7  # and 1.1-1.7x over Top-k; ahead of it, by more as P grows
    assert rows[1024]["gtopk"]["efficiency"] / rows[1024]["topk"]["efficiency"] > 2 * g / t
    topk = [rows[p]["topk"]["bytes"] for p in (256, 512)]
    gtopk = [rows[p]["gtopk"]["bytes"] for p in (256, 512)]
    assert topk[1] / topk[0] == pytest.approx(511 / 255)      # O(kP)
    assert gtopk[1] / gtopk[0] == pytest.approx(9 / 8)        # O(k log P)
  for rows in scaling.lowrank_table(args).values():
    for r in rows.values():
      assert 0.5 <= r["acpsgd"]["bytes"] / r["powersgd"]["bytes"] < 0.6
  torus = scaling.torus_table(args)
  for p in (1024, 2048, 4096):
    assert torus[p]["torus"]["bytes"] == pytest.approx(torus[p]["flat"]["bytes"], rel=1e-3)
    assert torus[p]["torus"]["latency_s"] * 10 < torus[p]["flat"]["latency_s"]
  assert torus[4]["flat"]["exchange_s"] == pytest.approx(torus[4]["torus"]["exchange_s"], rel=0.01)
