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
