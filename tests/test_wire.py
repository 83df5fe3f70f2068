"""Reading bytes off compiled programs and off hand-written HLO."""

from fractions import Fraction

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import optax
import pytest

import jaxcomp
from jaxcomp import training
from jaxcomp import wire
from jaxcomp._src import wire as wire_src
import harness

_ASYNC_HLO = """HloModule jit_step, entry_computation_layout={(f32[64]{0})->f32[64]{0}}, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%branch_p (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %ar.p = f32[64]{0} all-reduce(%p), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%add
}

%branch_q (q: f32[64]) -> f32[64] {
  %q = f32[64]{0} parameter(0)
  ROOT %ar.q = f32[16]{0} all-reduce(%q), channel_id=4, replica_groups=[1,4]<=[4], to_apply=%add
}

ENTRY %main (x: f32[64], pred: pred[]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %pred = pred[] parameter(1)
  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%agd), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  %ars = bf16[8]{0} all-reduce-start(%x), channel_id=5, replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = bf16[8]{0} all-reduce-done(%ars)
  %a2a = (u16[1,8]{1,0}, u16[1,8]{1,0}, u16[1,8]{1,0}, u16[1,8]{1,0}) all-to-all(%x), channel_id=6, replica_groups={}
  ROOT %c = f32[64]{0} conditional(%pred, %cpd, %cpd), branch_computations={%branch_p, %branch_q}
}
"""


def test_hand_written_hlo_async_tuples_groups_and_branches():
  sent = wire.collective_bytes(_ASYNC_HLO)
  kinds = {op.name: op for op in sent.ops}
  # all-gather-start: (operand, result); the gathered result is 256 bytes.
  assert kinds["ags"].bytes == Fraction(3 * 256, 4)
  # collective-permute-start: (operand, result, context...); sends its operand.
  assert kinds["cps"].bytes == 256
  # bf16 all-reduce over groups of two.
  assert kinds["ars"].group_size == 2 and kinds["ars"].bytes == Fraction(2 * 1 * 16, 2)
  # replica_groups={} is every device; tuple results add up.
  assert kinds["a2a"].group_size == 4 and kinds["a2a"].bytes == Fraction(3 * 64, 4)
  # Each branch of a two-way conditional counts half.
  assert kinds["ar.p"].weight == Fraction(1, 2) and kinds["ar.q"].weight == Fraction(1, 2)
  assert sent.by_kind["all-reduce"] == 16 + Fraction(2 * 3 * 256, 4) / 2 + Fraction(2 * 3 * 64, 4) / 2
  assert sent.total == sum(sent.by_kind.values())


def test_axes_are_read_from_the_device_groups():
  # Four devices as a (2, 2) mesh ("x", "y"): device d sits at (d // 2, d % 2).
  sent = wire.collective_bytes(_ASYNC_HLO, mesh_shape={"x": 2, "y": 2})
  axes = {op.name: op.axes for op in sent.ops}
  assert axes == {"ags": ("x", "y"), "cps": ("y",), "ars": ("y",), "a2a": ("x", "y"),
                  "ar.p": ("x", "y"), "ar.q": ("x", "y")}
  assert sum(sent.by_axes.values()) == sent.total
  transposed = _ASYNC_HLO.replace("replica_groups=[1,4]<=[4]", "replica_groups=[2,2]<=[2,2]T(1,0)")
  axes = {op.name: op.axes for op in wire.collective_bytes(
      transposed, mesh_shape={"x": 2, "y": 2}).ops}
  assert axes["ar.p"] == ("x",)  # groups {0, 2} and {1, 3}: down the columns


# Newer XLA's text (read off XLA:GPU's program of a bucketed step): an async start's
# operands as a tuple of their own, values and indices of a permute in one
# variadic collective, device groups stated by mesh axes.
_MESH_HLO = """HloModule jit_step, entry_computation_layout={(f32[64]{0})->f32[64]{0}}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x: f32[64], i: s32[16]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %i = s32[16]{0} parameter(1)
  %ars = ((f32[64]{0}), f32[64]{0}) all-reduce-start(%x), channel_id=1, replica_groups=mesh['data'=8] {'data'}, use_global_device_ids=true, to_apply=%add, output_to_operand_aliasing={{1}: (0, {})}
  %ard = f32[64]{0} all-reduce-done(%ars)
  %v = f32[16]{0} slice(%ard), slice={[0:16]}
  %cps = ((s32[16]{0}, f32[16]{0}), (s32[16]{0}, f32[16]{0})) collective-permute-start(%i, %v), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  %cpd = (s32[16]{0}, f32[16]{0}) collective-permute-done(%cps)
  %ags = ((f32[16]{0}), f32[64]{0}) all-gather-start(%v), channel_id=3, replica_groups=mesh['dcn'=2,'ici'=4] {'ici'}, dimensions={0}, use_global_device_ids=true
  %agd = f32[64]{0} all-gather-done(%ags)
  %rs = f32[32]{0} reduce-scatter(%agd), channel_id=4, replica_groups=mesh['dcn'=2,'ici'=4] {'dcn'}, dimensions={0}, to_apply=%add
  ROOT %ar = f32[64]{0} all-reduce(%agd), channel_id=5, replica_groups=mesh['x'=8] {'x':(2)2}, to_apply=%add
}
"""


def test_newer_xla_text_async_operand_tuples_and_mesh_axis_groups():
  sent = {op.name: op for op in wire.collective_bytes(_MESH_HLO).ops}
  # ((operand), result): the 256-byte result, not operand and result added up.
  assert sent["ars"].group_size == 8 and sent["ars"].buffer_bytes == 256
  assert sent["ars"].bytes == Fraction(2 * 7 * 256, 8)
  # One permute carries indices and values: both are sent, once.
  assert sent["cps"].buffer_bytes == 64 + 64 and sent["cps"].bytes == 128
  # Groups along 'ici' of (dcn 2, ici 4): four devices gather 64 bytes each.
  assert sent["ags"].group_size == 4 and sent["ags"].buffer_bytes == 256
  assert sent["rs"].group_size == 2 and sent["rs"].buffer_bytes == 2 * 128
  # 'x':(2)2: the second factor of x's 2 x 2 x 2, pairs of devices 2 apart.
  assert sent["ar"].group_size == 2


@pytest.mark.parametrize("groups, mesh_shape, axes", [
    ("mesh['dcn'=2,'ici'=4] {'ici'}", {"dcn": 2, "ici": 4}, ("ici",)),
    ("mesh['dcn'=2,'ici'=4] {'dcn'}", {"dcn": 2, "ici": 4}, ("dcn",)),
    ("mesh['dcn'=2,'ici'=4] {'ici','dcn'}", {"dcn": 2, "ici": 4}, ("dcn", "ici")),
])
def test_mesh_axis_groups_name_their_axes(groups, mesh_shape, axes):
  text = _MESH_HLO.replace("mesh['dcn'=2,'ici'=4] {'ici'}", groups)
  sent = {op.name: op for op in wire.collective_bytes(text, mesh_shape=mesh_shape).ops}
  assert sent["ags"].axes == axes


@pytest.mark.parametrize("groups, expected", [
    ("mesh['data'=8] {'data'}", [list(range(8))]),
    ("mesh['dcn'=2,'ici'=4] {'ici'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['dcn'=2,'ici'=4] {'dcn'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    # Sub-axes: (pre)size, pre the sizes of the parts before it (major first).
    ("mesh['x'=4] {'x':(1)2}", [[0, 2], [1, 3]]),
    ("mesh['x'=4] {'x':(2)2}", [[0, 1], [2, 3]]),
    # Two sub-axes of one axis, in the listed order: the later listed varies fastest.
    ("mesh['x'=8] {'x':(4)2,'x':(1)2}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
    # A device order other than 0, 1, 2, ...: groups of the devices at those places.
    ("mesh['a'=2,'b'=2], device_ids=([[0,2],[1,3]]) {'b'}", [[0, 2], [1, 3]]),
    ("mesh['a'=2,'b'=2] {}", [[0], [1], [2], [3]]),
])
def test_mesh_axis_groups_follow_xla_s_rule(groups, expected):
  assert wire_src._groups(f"all-reduce(%x), replica_groups={groups}, to_apply=%add") == expected


def test_compiled_collectives_use_the_ring_formulas():
  mesh = training.make_mesh(8)
  n = 64

  def per_device(x):
    x = x[0]
    parts = [
        lax.psum(x, "data"),
        lax.all_gather(x, "data", tiled=True)[:n],
        jnp.tile(lax.psum_scatter(x, "data", tiled=True), 8),
        lax.ppermute(x, "data", [(i, (i + 1) % 8) for i in range(8)]),
        lax.all_to_all(x.reshape(8, -1), "data", 0, 0, tiled=True).reshape(-1),
    ]
    return sum(parts)[None]

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"),
                             out_specs=P("data"), check_vma=False))
  sent = wire.collective_bytes(fn.lower(jnp.ones((8, n))).compile())
  s = 4 * n
  assert sent.by_kind == {
      "all-reduce": Fraction(2 * 7 * s, 8),
      "all-gather": Fraction(7 * 8 * s, 8),
      "reduce-scatter": Fraction(7 * s, 8),
      "collective-permute": Fraction(s),
      "all-to-all": Fraction(7 * s, 8),
  }


def test_expected_bytes_needs_a_compressor():
  with pytest.raises(TypeError, match="`tx` must be a jaxcomp compressor"):
    wire.expected_bytes(optax.sgd(0.1), {}, 8)
  with pytest.raises(TypeError, match="`compiled`"):
    wire.collective_bytes(3)


def test_expected_bytes_for_a_pair_needs_the_mesh_shape():
  tx = jaxcomp.allreduce(("x", "y"))
  with pytest.raises(ValueError, match=r"mesh shape \(rows, cols\)"):
    wire.expected_bytes(tx, {"w": jnp.ones(8)}, 8)
  assert wire.expected_bytes(tx, {"w": jnp.ones(8)}, (2, 4)).total == (
      wire.expected_bytes(tx, {"w": jnp.ones(8)}, {"x": 2, "y": 4}).total
  )


# ------------------------------------------------------------------ compressors in a chain

PARAMS = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,)), "c": jnp.zeros((3, 4, 5))}  # n = 264


def _compiled_bytes(tx, params, num_devices=8):
  """The bytes of one compiled ``tx.update`` step on a ring, per device."""
  mesh = training.make_mesh(num_devices)
  state = training.init_state(tx, params, mesh, "data")
  grads = jax.tree.map(lambda x: jnp.ones((num_devices,) + x.shape), params)
  return wire.collective_bytes(training.make_update(tx, mesh, "data").lower(grads, state).compile())


def test_expected_bytes_finds_the_compressor_in_a_chain():
  """The formula of the compressor inside ``optax.chain``: what the chain's program sends."""
  k = 14  # ceil(0.05 * 264)
  alone = wire.expected_bytes(jaxcomp.gtopk(0.05, "data"), PARAMS, 8)
  assert alone.by_kind == {"collective-permute": 3 * 8 * k}
  chained = optax.chain(jaxcomp.gtopk(0.05, "data"), optax.sgd(0.1, momentum=0.9))
  assert wire.expected_bytes(chained, PARAMS, 8).by_kind == alone.by_kind
  assert _compiled_bytes(chained, PARAMS).by_kind == alone.by_kind


def test_expected_bytes_finds_the_compressor_in_multisteps():
  tx = optax.MultiSteps(optax.chain(jaxcomp.gtopk(0.05, "data"), optax.sgd(0.1)),
                        every_k_schedule=2)
  alone = wire.expected_bytes(jaxcomp.gtopk(0.05, "data"), PARAMS, 8)
  assert wire.expected_bytes(tx, PARAMS, 8).by_kind == alone.by_kind
  assert _compiled_bytes(tx, PARAMS).by_kind == alone.by_kind


def test_expected_bytes_finds_the_compressor_in_multisteps_gradient_transformation():
  inner = optax.chain(jaxcomp.gtopk(0.05, "data"), optax.sgd(0.1))
  tx = optax.MultiSteps(inner, every_k_schedule=2).gradient_transformation()
  alone = wire.expected_bytes(jaxcomp.gtopk(0.05, "data"), PARAMS, 8)
  assert wire.expected_bytes(tx, PARAMS, 8).by_kind == alone.by_kind


def test_expected_bytes_adds_every_compressor_of_a_chain():
  """Two compressors in one chain: both formulas count (the search finds each once)."""
  tx = optax.chain(jaxcomp.topk(0.05, "data"), jaxcomp.allreduce("data"))
  want = (wire.expected_bytes(jaxcomp.topk(0.05, "data"), PARAMS, 8).total
          + wire.expected_bytes(jaxcomp.allreduce("data"), PARAMS, 8).total)
  assert wire.expected_bytes(tx, PARAMS, 8).total == want
  assert _compiled_bytes(tx, PARAMS).by_kind == wire.expected_bytes(tx, PARAMS, 8).by_kind


_MASK = {"w": True, "b": False, "c": True}


@pytest.mark.parametrize("wrap", [
    lambda tx: optax.masked(tx, _MASK),
    lambda tx: optax.chain(harness.Clipped(tx, 0.5), optax.sgd(0.1)),
    lambda tx: optax.chain(tx, optax.apply_if_finite(optax.sgd(0.1), 3)),
    lambda tx: optax.chain(tx, optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)),
    lambda tx: optax.chain(optax.masked(tx, _MASK),
                           harness.Clipped(jaxcomp.topk(0.05, "data"), 2.0)),
], ids=["masked", "user_class", "apply_if_finite_after", "inject_hyperparams", "two"])
def test_expected_bytes_prices_what_each_compressor_is_given(wrap):
  """The formula on the leaves each compressor sees: what the compiled program sends."""
  tx = wrap(jaxcomp.gtopk(0.05, "data"))
  want = wire.expected_bytes(tx, PARAMS, 8)
  assert want.total > 0
  assert _compiled_bytes(tx, PARAMS).by_kind == want.by_kind


def test_a_masked_compressor_is_priced_on_its_leaves():
  tx = jaxcomp.gtopk(0.05, "data")
  masked = {k: v for k, v in PARAMS.items() if _MASK[k]}  # n = 252
  assert (wire.expected_bytes(optax.masked(tx, _MASK), PARAMS, 8).by_kind
          == wire.expected_bytes(tx, masked, 8).by_kind
          == {"collective-permute": 3 * 8 * 13})  # k = ceil(0.05 * 252)


def test_expected_bytes_of_a_plain_optimizer_is_a_type_error():
  for tx in (optax.sgd(0.1), optax.chain(optax.clip(1.0), optax.adamw(1e-3)),
             optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)):
    with pytest.raises(TypeError, match="`tx` must be a jaxcomp compressor"):
      wire.expected_bytes(tx, PARAMS, 8)


def test_acpsgd_branches_are_reported_by_branch():
  """Branch 0 the P step, branch 1 the Q step: one all-reduce each, half the steps each."""
  params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}
  rank = 2
  tx = jaxcomp.acpsgd(rank, "data")
  sent = _compiled_bytes(tx, params)
  want = wire.expected_bytes(tx, params, 8)
  p_step = Fraction(2 * 7 * 4 * (rank * 16 + 12), 8)  # P factor and the dense bias
  q_step = Fraction(2 * 7 * 4 * (rank * 12 + 12), 8)  # Q factor and the dense bias
  assert want.by_branch == {0: p_step, 1: q_step}
  assert sent.by_branch == want.by_branch
  assert sent.by_kind == want.by_kind == {"all-reduce": (p_step + q_step) / 2}
  assert [(op.branch, op.weight) for op in sent.ops] == [(0, Fraction(1, 2)), (1, Fraction(1, 2))]
