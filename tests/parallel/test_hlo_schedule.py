"""What runs between an asynchronous collective's start and done, read off a scheduled module's text: pairs
matched by operand, per computation, in schedule order; kernels told apart from bookkeeping."""

from jaxtrain.parallel import hlo_schedule

TEXT = """HloModule jit_call, is_scheduled=true

%region (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main.7_spmd (p0: f32[64], p1: f32[64,64]) -> f32[64] {
  %p0 = f32[64]{0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  %all-to-all-start = ((f32[64]{0}), f32[64]{0}) all-to-all-start(%p0), replica_groups={{0,1}}, metadata={op_name="jit(call)/call_step_1/diloco_sync/all_to_all"}
  %gemm_fusion_dot.3 = f32[64,64]{1,0} fusion(%p1, %p1), kind=kCustom, calls=%region, metadata={op_name="jit(call)/call_step_2/dot_general"}
  %gte = f32[64]{0} get-tuple-element(%p0), index=0
  %loop_add_fusion = f32[64]{0} fusion(%p0), kind=kLoop, calls=%region, metadata={op_name="jit(call)/call_step_2/add"}
  %all-to-all-done = f32[64]{0} all-to-all-done(%all-to-all-start)
  %all-reduce-start.1 = f32[64]{0} all-reduce-start(%all-to-all-done), to_apply=%region
  ROOT %all-reduce-done.1 = f32[64]{0} all-reduce-done(%all-reduce-start.1)
}
"""


def test_pairs_and_what_runs_between():
  first, second = hlo_schedule.spans(TEXT)
  assert (first.computation, first.kind) == ("main.7_spmd", "all-to-all")
  assert first.start.op_name == "jit(call)/call_step_1/diloco_sync/all_to_all"
  assert [i.name for i in first.between] == ["gemm_fusion_dot.3", "gte", "loop_add_fusion"]
  assert [i.name for i in first.compute] == ["gemm_fusion_dot.3", "loop_add_fusion"]  # not the tuple access
  assert (second.kind, second.between, second.done.name) == ("all-reduce", (), "all-reduce-done.1")


def test_computations_keep_schedule_order():
  comps = hlo_schedule.computations(TEXT)
  assert list(comps) == ["region", "main.7_spmd"]
  assert [i.opcode for i in comps["region"]] == ["parameter", "parameter", "add"]


WINDOWS = """HloModule jit_step, is_scheduled=true

%fused_dot (a: f32[8,16], b: f32[16,32]) -> f32[8,32] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,32]{1,0} parameter(1)
  ROOT %dot = f32[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gather (g: f32[4]) -> f32[32] {
  %g = f32[4]{0} parameter(0)
  ROOT %all-gather.1 = f32[32]{0} all-gather(%g), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

ENTRY %main (p0: f32[8,16], p1: f32[16,32], p2: f32[64], p3: f32[4]) -> f32[8,32] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  %p2 = f32[64]{0} parameter(2)
  %p3 = f32[4]{0} parameter(3)
  %copy-start = (f32[64]{0}, f32[64]{0}, u32[]) copy-start(%p2)
  %dot.0 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy-done = f32[64]{0} copy-done(%copy-start)
  %all-reduce-start = f32[64]{0} all-reduce-start(%p2), replica_groups={{0,1}}, to_apply=%fused_dot
  %async-collective-start.2 = (f32[4]{0}, f32[32]{0}) fusion(%p3), kind=kCustom, calls=%gather
  %fusion.1 = f32[8,32]{1,0} fusion(%p0, %p1), kind=kOutput, calls=%fused_dot
  %all-reduce-done = f32[64]{0} all-reduce-done(%all-reduce-start)
  %fusion.2 = f32[8,32]{1,0} fusion(%p0, %p1), kind=kOutput, calls=%fused_dot
  %async-collective-done.2 = f32[32]{0} fusion(%async-collective-start.2), kind=kCustom, calls=%gather
  ROOT %fusion.3 = f32[8,32]{1,0} fusion(%p0, %p1), kind=kOutput, calls=%fused_dot
}
"""
DOT = 2 * 8 * 32 * 16  # one [8,16] x [16,32] matmul: 2 FLOPs per multiply-add


def test_windows_count_the_matmuls_each_transfer_may_hide_behind():
  win = hlo_schedule.windows(WINDOWS)
  assert win.flops == 4 * DOT  # the module's four matmuls, fused or not
  # fusion.1 runs while both transfers are in flight: it counts once, for the older (the
  # all-reduce);
  # fusion.2 runs beside the TPU-style async collective fusion alone; dot.0 beside a copy only
  assert win.of("all-reduce-start") == DOT
  # the collective wrapped in the async fusion: its pair's window
  assert win.of("all-gather.1") == DOT
  assert win.window == {"all-reduce-start": DOT, "async-collective.2": DOT}
  assert sum(win.window.values()) <= win.flops
  assert win.of("some-synchronous-all-reduce") == 0.0


def test_tpu_async_collective_fusions_pair_up_as_spans():
  pairs = {s.start.name: s for s in hlo_schedule.spans(WINDOWS)}
  # the copy is not a collective
  assert set(pairs) == {"all-reduce-start", "async-collective-start.2"}
  span = pairs["async-collective-start.2"]
  assert (span.kind, span.done.name) == ("all-gather", "async-collective-done.2")
  assert [i.name for i in span.between] == ["fusion.1", "all-reduce-done", "fusion.2"]


CONVOLUTIONS = """HloModule jit_step, is_scheduled=true

ENTRY %main (p0: f32[4,8,16], p1: f32[4,16,32], p2: f32[1,8,16], p3: f32[2,16,32], p4: f32[1,16,32]) -> f32[4,8,32] {
  %p0 = f32[4,8,16]{2,1,0} parameter(0)
  %p1 = f32[4,16,32]{2,1,0} parameter(1)
  %p2 = f32[1,8,16]{2,1,0} parameter(2)
  %p3 = f32[2,16,32]{2,1,0} parameter(3)
  %p4 = f32[1,16,32]{2,1,0} parameter(4)
  %conv.0 = f32[4,8,32]{2,1,0} convolution(%p0, %p1), window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0io->0bf
  %conv.1 = f32[2,8,32]{2,1,0} convolution(%p2, %p3), window={size=2 pad=1_1 rhs_reversal=1}, dim_labels=0bf_0io->0bf
  ROOT %conv.2 = f32[4,8,32]{2,1,0} convolution(%p0, %p4), window={size=1}, dim_labels=0bf_0io->0bf
}
"""


def test_convolutions_count_only_the_taps_that_hit_input():
  # XLA:TPU's batched matmuls: conv.0 is 4 [8,16]x[16,32] matmuls, the batch dimension written as a
  # dilated window of 4 taps of which one lands on input per output; conv.1 broadcasts one [8,16]
  # over 2 kernels through a padded window of 2 (one tap of 2 lands); conv.2 is a plain per-position
  # matmul of size-1 window. Counting every tap would read 4x, 2x and 1x these.
  assert hlo_schedule.windows(CONVOLUTIONS).flops == 4 * DOT + 2 * DOT + 4 * DOT
