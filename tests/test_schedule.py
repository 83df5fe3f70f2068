"""``experiments.schedule``: exchanges and backward gemms read off a scheduled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import schedule

# XLA:GPU's shape of a scheduled step: library and Triton matrix kernels, one inside
# a command buffer (a call), an asynchronous all-reduce and permute, a synchronous
# all-reduce. Forward kernels are under jvp(...), backward ones under transpose(...).
_GPU_HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%gemm_fusion_dot (p0: f32[8,64], p1: f32[8,32]) -> f32[64,32] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[8,32]{1,0} parameter(1)
  ROOT %dot = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/shard_map/transpose(jvp())/dot_general"}
}

%command_buffer (c0: f32[8,64], c1: f32[8,32]) -> f32[64,32] {
  %c0 = f32[8,64]{1,0} parameter(0)
  %c1 = f32[8,32]{1,0} parameter(1)
  ROOT %gemm_fusion.1 = f32[64,32]{1,0} fusion(%c0, %c1), kind=kCustom, calls=%gemm_fusion_dot, backend_config={"kind":"__triton_nested_gemm_fusion"}
}

ENTRY %main (x: f32[8,64], w: f32[64,32], y: f32[8,32]) -> f32[64,32] {
  %x = f32[8,64]{1,0} parameter(0)
  %w = f32[64,32]{1,0} parameter(1)
  %y = f32[8,32]{1,0} parameter(2)
  %forward = f32[8,32]{1,0} custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/jvp()/dot_general"}
  %last_layer = f32[64,32]{1,0} custom-call(%x, %y), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/transpose(jvp())/dot_general"}
  %ars = ((f32[64,32]{1,0}), f32[64,32]{1,0}) all-reduce-start(%last_layer), channel_id=1, replica_groups=mesh['data'=8] {'data'}, to_apply=%add
  %middle_layer = f32[64,32]{1,0} call(%x, %y), to_apply=%command_buffer
  %ard = f32[64,32]{1,0} all-reduce-done(%ars)
  %first_layer = f32[64,32]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm_fusion_dot
  %tanh = f32[64,32]{1,0} tanh(%first_layer), metadata={op_name="jit(step)/shard_map/transpose(jvp())/tanh"}
  %ar = f32[64,32]{1,0} all-reduce(%tanh), channel_id=2, replica_groups=mesh['data'=8] {'data'}, to_apply=%add
  %cps = ((f32[64,32]{1,0}), f32[64,32]{1,0}) collective-permute-start(%ar), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[64,32]{1,0} collective-permute-done(%cps)
}
"""


def test_the_schedule_of_a_gpu_program():
  read = schedule.read(_GPU_HLO)
  # The permute and both all-reduces; the asynchronous ones as one each.
  assert read.exchanges == 3 and read.asynchronous == 2
  # Three backward gemms (a library call, one in a command buffer, a Triton
  # fusion); the forward one and the tanh are not counted.
  assert read.gemms == 3
  # The all-reduce starts after the last layer's gemm: two remain, one of them
  # while it is in flight.
  assert read.after_first == 2 and read.in_flight == 1


def test_a_program_without_an_entry_is_refused():
  with pytest.raises(ValueError, match="ENTRY"):
    schedule.read("HloModule m\n")


# Four layers of 2 MiB: DDP's rule gives two buckets, the last layer alone first.
SHAPES = {f"l{i}": jax.ShapeDtypeStruct((512, 1024), jnp.float32) for i in range(4)}


@pytest.mark.parametrize("row, buckets", [("allreduce", 1), ("allreduce_buckets", 2)])
def test_the_compiled_step_on_cpu(row, buckets):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (schedule.AXIS,))
  (found,) = schedule.programs(row, SHAPES, mesh)
  assert found.buckets == buckets
  # One all-reduce per bucket; one backward gemm per layer.
  assert found.schedule.exchanges == buckets and found.schedule.gemms == 4
  if buckets == 1:  # the one exchange needs every gradient
    assert found.schedule.after_first == 0
  assert found.schedule.in_flight == 0  # XLA:CPU's collectives are synchronous
  # Dense's ring all-reduce of the 8 MiB gradient, 2 (P - 1) / P of it.
  assert found.read_mb == found.formula_mb == 2 * 7 / 8 * 4 * 4 * 512 * 1024 / 1e6


def test_every_form_of_acpsgd_is_a_program():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (schedule.AXIS,))
  found = schedule.programs("acpsgd_buckets", SHAPES, mesh)
  assert [r.form for r in found] == [0, 1]
  assert all(r.schedule.exchanges == r.buckets == 2 for r in found)
  # The P and Q steps send different bytes; the formula is their mean.
  assert found[0].read_mb != found[1].read_mb
  assert (found[0].read_mb + found[1].read_mb) / 2 == pytest.approx(found[0].formula_mb, rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["--rows", "nope"], "unknown"),
    (["--devices", "1"], "--devices"),
    (["--mock-gpus"], "shard_autotuning"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")  # read by the check, not by XLA: it has started
  with pytest.raises(SystemExit):
    schedule.main(argv)
  assert message in capsys.readouterr().err


def test_the_report_is_a_table_of_every_program():
  rows = [schedule.Row("acpsgd_buckets", form, 5, 1.25, schedule.Schedule(5, 5, 54, 52, 52),
                       1.9169, 1.5337) for form in (0, 1)]
  text = schedule.report(rows, ["--mock-gpus"], 8, mocked=False, model="transformer")
  assert "over the leaves of transformer" in text
  assert "`python -m experiments.schedule --mock-gpus`" in text
  assert "| acpsgd_buckets | 1 | 5 | 5 | 5 | 54 | 52 | 52 | 1.917 | 1.534 | 1.2 |" in text
  assert text.count("| acpsgd_buckets |") == 2
