"""Bytes counted in compiled HLO: exact per the ring formulas, attributed to the mesh axes the groups span,
weighted by comm_every_N scopes and loop trip counts; every replica_groups form XLA prints; async -start
forms and tuples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.parallel import hlo_bytes


def mesh_of(devices):
  return Mesh(np.asarray(devices).reshape(4, 2), ("replica", "data"))


def compiled(mesh) -> str:
  """A psum of f32[1024], an all-to-all of bf16 carried as u16, an all-gather once every 10 steps and a
  ppermute, each over replica (4 shards of 2-way replicated data)."""
  def f(x, y, z):
    summed = jax.lax.psum(x, "replica")
    moved = jax.lax.all_to_all(y, "replica", 0, 0)
    with jax.named_scope("comm_every_10"):
      gathered = jax.lax.all_gather(z, "replica", tiled=True, to="invarying")
    shifted = jax.lax.ppermute(x, "replica", [(i, (i + 1) % 4) for i in range(4)])
    return summed, moved, gathered, shifted

  g = jax.shard_map(f, mesh=mesh, axis_names={"replica"}, in_specs=(P("replica"),) * 3,
                    out_specs=(P(), P("replica"), P(), P("replica")))
  x = jnp.zeros((4 * 1024,), jnp.float32)
  y = jax.lax.bitcast_convert_type(jnp.zeros((4 * 4, 256), jnp.bfloat16), jnp.uint16)  # [4, 256] per shard
  z = jnp.zeros((4 * 8,), jnp.float32)
  with jax.set_mesh(mesh):
    return jax.jit(g).lower(x, y, z).compile().as_text()


@pytest.fixture(scope="module")
def rows():
  mesh = mesh_of(jax.devices())
  return {r.kind: r for r in hlo_bytes.collectives(compiled(mesh), mesh)}


def test_each_collective_counts_its_ring_bytes(rows):
  assert sorted(rows) == ["all-gather", "all-reduce", "all-to-all", "collective-permute"]
  psum, a2a, gather, permute = (rows[k] for k in ("all-reduce", "all-to-all", "all-gather", "collective-permute"))
  assert (psum.dtype, psum.operand_bytes, psum.group_size, psum.axes) == ("f32", 4096, 4, ("replica",))
  assert psum.bytes_sent == 2 * 3 / 4 * 4096 == 6144
  # XLA splits the all-to-all's operand in 4: a tuple (u16[1,256], u16[1,256], u16[1,256], u16[1,256])
  assert (a2a.dtype, a2a.operand_bytes, a2a.result_bytes, a2a.group_size) == ("u16", 2048, 2048, 4)
  assert a2a.bytes_sent == 3 / 4 * 2048 == 1536
  assert (gather.operand_bytes, gather.result_bytes, gather.bytes_sent) == (32, 128, 96)
  assert (permute.operand_bytes, permute.bytes_sent, permute.group_size, permute.axes) == (4096, 4096, 4, ("replica",))


def test_comm_every_n_divides_the_bytes_per_step(rows):
  gather = rows["all-gather"]
  assert "comm_every_10" in gather.op_name and gather.every == 10 and gather.per_step == pytest.approx(9.6)
  assert all(rows[k].every == 1 and rows[k].per_step == rows[k].bytes_sent for k in ("all-reduce", "all-to-all"))
  assert hlo_bytes.every_of("jit(step)/cond/branch_1_fun/comm_every_10/comm_every_2/psum") == 20
  assert hlo_bytes.every_of("jit(step)/transpose(jvp(comm_every_4))/psum") == 4
  assert hlo_bytes.every_of("jit(step)/comm_every_10x/comm_peak/psum") == 1


def test_loops_multiply_and_a_synced_branch_divides():
  """A psum in a 3-step scan runs 3 times a step; one in a lax.cond branch scoped comm_every_10 (a DiLoCo
  outer sync) once every 10 steps."""
  def f(step, x):
    def sync(x):
      with jax.named_scope("comm_every_10"):
        return jax.lax.pcast(jax.lax.pmean(x, "replica"), "replica", to="varying")
    x = jax.lax.scan(lambda c, _: (jnp.sin(c) + jax.lax.psum(c, "replica"), None), x, None, length=3)[0]
    return jax.lax.cond(step % 10 == 0, sync, lambda x: x, x)

  mesh = mesh_of(jax.devices())
  g = jax.shard_map(f, mesh=mesh, axis_names={"replica"}, in_specs=(P(), P("replica")), out_specs=P("replica"))
  with jax.set_mesh(mesh):
    text = jax.jit(g).lower(jnp.zeros((), jnp.int32), jnp.zeros((4 * 256,))).compile().as_text()
  looped, synced = sorted(hlo_bytes.collectives(text, mesh), key=lambda r: r.every)
  assert (looped.runs, looped.every, looped.bytes_sent, looped.per_step) == (3, 1, 1536, 3 * 1536)
  assert (synced.runs, synced.every, synced.bytes_sent) == (1, 10, 1536) and synced.per_step == pytest.approx(153.6)
  assert hlo_bytes.syncs([looped, synced]) == {10: 1536}  # one sync's bytes, not its average per step


def test_by_axis_and_total(rows):
  table = hlo_bytes.by_axis(list(rows.values()))
  assert table == pytest.approx({("replica", "f32"): 6144 + 9.6 + 4096, ("replica", "u16"): 1536})
  assert hlo_bytes.total(list(rows.values())) == pytest.approx(6144 + 9.6 + 4096 + 1536)


def test_group_ids_are_positions_in_the_mesh_not_device_ids():
  # XLA prints logical ids (indices into the executable's device assignment, the mesh's flat order):
  # the same groups {{0,2,4,6},{1,3,5,7}} for a mesh whose devices are in another order.
  mesh = mesh_of(jax.devices()[::-1])
  text = compiled(mesh)
  assert "replica_groups={{0,2,4,6},{1,3,5,7}}" in text
  assert {r.axes for r in hlo_bytes.collectives(text, mesh)} == {("replica",)}


HEADER = "HloModule m, entry_computation_layout={(f32[8]{0})->f32[32]{0}}, num_partitions=8\n\nENTRY %main {\n"
GROUPS = "channel_id=1, {groups}, use_global_device_ids=true, to_apply=%add"


@pytest.mark.parametrize("groups, axes, size", [
    ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("replica",), 4),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", ("replica",), 4),
    ("replica_groups=[4,2]<=[8]", ("data",), 2),
    ("replica_groups={}", ("replica", "data"), 8),
    ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", ("replica", "data"), 8),
    ("replica_groups=mesh['a'=4,'b'=2] {'a'}", ("replica",), 4),
    ("replica_groups=mesh['a'=8] {'a':(4)2}", ("data",), 2),
    ("replica_groups=mesh['a'=4,'b'=2], device_ids=([4,2]<=[2,4]T(1,0)) {'b'}", ("replica",), 2),
    # GSPMD's own, for moe_tiny on replica=2, data=2, expert=2: the mesh's device ids as a bare iota
    ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", ("data",), 2),
])
def test_every_replica_groups_form(groups, axes, size):
  text = HEADER + (f"  %p = f32[1024]{{0}} parameter(0)\n  ROOT %r = f32[1024]{{0}} all-reduce(%p), "
                   f"{GROUPS.format(groups=groups)}\n}}\n")
  (row,) = hlo_bytes.collectives(text, mesh_of(jax.devices()))
  assert (row.axes, row.group_size, row.bytes_sent) == (axes, size, 2 * (size - 1) / size * 4096)


def test_async_start_forms_and_inline_operand_shapes():
  groups = GROUPS.format(groups="replica_groups={{0,2,4,6},{1,3,5,7}}")
  text = HEADER + (
      "  %p = f32[8]{0} parameter(0)\n"
      f"  %ags = (f32[8]{{0}}, f32[32]{{0}}) all-gather-start(f32[8]{{0}} %p), {groups}, dimensions={{0}}\n"
      "  %agd = f32[32]{0} all-gather-done((f32[8]{0}, f32[32]{0}) %ags)\n"
      f"  %ars = (bf16[2,2]{{1,0}}, s4[3]{{0}}) all-reduce-start(%q, %s), {groups}\n"
      "  %ard = (bf16[2,2]{1,0}, s4[3]{0}) all-reduce-done(%ars)\n}\n")
  text = text.replace("  %ars", "  %q = bf16[2,2]{1,0} parameter(1)\n  %s = s4[3]{0} parameter(2)\n  %ars")
  gather, reduce = hlo_bytes.collectives(text, mesh_of(jax.devices()))
  assert (gather.kind, gather.operand_bytes, gather.result_bytes, gather.bytes_sent) == ("all-gather", 32, 128, 96)
  assert (reduce.kind, reduce.dtypes, reduce.operand_bytes) == ("all-reduce", ("bf16", "s4"), 8 + 1.5)
  assert hlo_bytes.by_axis([reduce]) == pytest.approx({("replica", "bf16"): 1.5 * 8, ("replica", "s4"): 1.5 * 1.5})


def test_element_sizes():
  parts = hlo_bytes.shape_parts("(pred[], s4[3]{0}, u4[2], f8e4m3fn[4], bf16[2,2]{1,0}, f32[1024]{0}, token[])")
  assert [b for _, b in parts] == [1, 1.5, 1, 4, 8, 4096, 0]


TPU_LOOP = """HloModule m, num_partitions=4

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %limit = s32[] constant(6)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p.1), index=1
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  ROOT %t.1 = (s32[], f32[8]) tuple(%i.1, %x)
}

ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
  %a = f32[8] parameter(0)
  %one = s32[] constant(1)
  %t = (s32[], f32[8]) tuple(%one, %a)
  ROOT %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
}
"""


def test_trip_count_read_off_a_loop_without_known_trip_count():
  """XLA:TPU leaves no known_trip_count on a scan's while loop: `counter < 6` from an init of 1 runs
  the body 5 times (and a loop it cannot read, once)."""
  comps = hlo_bytes._computations(TPU_LOOP)
  assert hlo_bytes._runs(comps)["body"] == 5
  unreadable = TPU_LOOP.replace("direction=LT", "direction=NE")
  assert hlo_bytes._runs(hlo_bytes._computations(unreadable))["body"] == 1


TPU_BRANCH = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%sync (b: f32[64]) -> f32[64] {
  %b = f32[64] parameter(0)
  %a2a = f32[64] all-to-all(%b), REPLICA, dimensions={0},
      metadata={op_name="BRANCH/comm_every_2/all_to_all"}
  %dus = f32[64] add(%a2a, %a2a), metadata={op_name="BRANCH/dynamic_update_slice"}
  ROOT %all-reduce = f32[64] all-reduce(%dus), REPLICA, to_apply=%add
}

%skip (c: f32[64]) -> f32[64] {
  ROOT %c = f32[64] parameter(0)
}

ENTRY %main (p: s32[], v: f32[64]) -> f32[64] {
  %p = s32[] parameter(0)
  %v = f32[64] parameter(1)
  ROOT %r = f32[64] conditional(%p, %v, %v), branch_computations={%skip, %sync}
}
""".replace(",\n      metadata", ", metadata").replace(
    "BRANCH", "jit(step)/cond/branch_1_fun").replace(
    "REPLICA", "channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true")


def test_a_collective_written_without_metadata_takes_its_branchs_period():
  """XLA:TPU rewrites a DiLoCo sync's all-gather into an all-reduce with no op_name, in the branch
  where the sync's named all-to-all runs every 2 steps: both count once every 2 steps (read as every
  step before, the sync's bytes per step were 2.5x those of the same sync on GPU)."""
  mesh = mesh_of(jax.devices())
  rows = {r.kind: r for r in hlo_bytes.collectives(TPU_BRANCH, mesh)}
  assert rows["all-reduce"].op_name == "" and rows["all-reduce"].every == 2
  assert rows["all-to-all"].every == 2
  mixed = TPU_BRANCH.replace("comm_every_2/all_to_all", "all_to_all")
  assert {r.every for r in hlo_bytes.collectives(mixed, mesh)} == {1}
