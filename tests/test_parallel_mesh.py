"""Mesh construction from config and logical-axis rules (8 fake CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.sharding import rules
from k3jax.sharding.mesh import AXES, MeshConfig, make_mesh, resolve_sizes


def test_minus_one_takes_the_remaining_devices():
  mesh = make_mesh(MeshConfig(data=-1, expert=2, context=2))
  assert mesh.axis_names == AXES
  assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 1, "expert": 2, "context": 2}
  assert sorted(d.id for d in mesh.devices.ravel()) == list(range(8))
  assert dict(make_mesh({"context": 8, "data": 1}).shape)["context"] == 8
  assert dict(make_mesh().shape)["data"] == 8
  assert resolve_sizes(MeshConfig(data=2, fsdp=-1, expert=2), 16) == (1, 2, 4, 2, 1)
  assert resolve_sizes(MeshConfig(data=-1, stage=4), 8) == (4, 2, 1, 1, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(data=-1, expert=-1), "at most one axis may be -1"),
    (dict(data=0), "MeshConfig.data=0"),
    (dict(context=2.0), "MeshConfig.context=2.0"),
    (dict(expert=True), "MeshConfig.expert=True"),
])
def test_config_rejects_bad_sizes(kwargs, match):
  with pytest.raises(ValueError, match=match):
    MeshConfig(**kwargs)


def test_sizes_must_fit_the_devices():
  with pytest.raises(ValueError, match="has 4 devices, but 8 are available"):
    make_mesh(MeshConfig(data=2, expert=2))
  with pytest.raises(ValueError, match="multiply to 3, which does not divide the 8 devices"):
    make_mesh(MeshConfig(data=-1, expert=3))
  with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]"):
    make_mesh({"model": 2})
  assert dict(make_mesh(MeshConfig(data=2, context=2), devices=jax.devices()[:4]).shape) == {
      "stage": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 2}


def test_logical_to_spec():
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
  r = rules.DEFAULT_RULES
  assert rules.logical_to_spec(("expert", "embed", "mlp"), mesh, r) == P("expert", "fsdp")
  # Size-1 context is dropped; batch spans data, fsdp and expert.
  spec = rules.logical_to_spec(("batch", "length", "embed"), mesh, r)
  # fsdp is already used by the batch: not reused for embed.
  assert spec == P(("data", "fsdp", "expert"))
  with pytest.raises(ValueError, match=r"dimension 0 \('expert'\) of size 5 is not divisible"):
    rules.logical_to_spec(("expert", "embed"), mesh, r, shape=(5, 4))
  with pytest.raises(ValueError, match="logical axis 'layers' has no rule"):
    rules.logical_to_spec(("layers",), mesh, r)
  with pytest.raises(ValueError, match="mesh axis 'tensor'"):
    rules.logical_to_spec(("embed",), mesh, rules.make_rules({"embed": "tensor"}))
  with pytest.raises(ValueError, match="two rules"):
    rules.make_rules([("embed", None), ("embed", "fsdp")])
  assert rules.make_rules({"embed": ["data", "fsdp"]}) == (("embed", ("data", "fsdp")),)


class _Tiny(nnx.Module):

  def __init__(self):
    self.w = nnx.Param(jnp.arange(64.0).reshape(8, 8), out_sharding=("expert", "embed"),
                       eager_sharding=False)
    self.b = nnx.Param(jnp.ones((8,)), out_sharding=("mlp",), eager_sharding=False)
    self.c = nnx.Param(jnp.ones((3,)))


def test_params_and_optimizer_state_follow_the_rules():
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
  params = nnx.state(_Tiny(), nnx.Param)
  opt_state = optax.adam(1e-3).init(params)
  tree = {"params": params, "opt": opt_state}
  placed = rules.shard_tree(tree, mesh)
  assert placed["params"]["w"].get_value().sharding.spec == P("expert", "fsdp")
  assert placed["params"]["b"].get_value().sharding.spec == P()
  assert placed["params"]["c"].get_value().sharding.spec == P()
  mu = placed["opt"][0].mu
  assert mu["w"].get_value().sharding.spec == P("expert", "fsdp")
  # The step counter has no names: replicated.
  assert placed["opt"][0].count.sharding.spec == P()
  # Each device holds a quarter of w.
  assert placed["params"]["w"].get_value().addressable_shards[0].data.shape == (4, 4)
  np.testing.assert_array_equal(np.asarray(placed["params"]["w"].get_value()),
                                np.arange(64.0).reshape(8, 8))


def test_constrain_is_a_noop_without_a_mesh_and_shards_with_one():
  x = jnp.ones((8, 4, 2))
  assert rules.constrain(x, ("batch", "length", "embed")) is x
  mesh = make_mesh(MeshConfig(data=4, context=2))

  @jax.jit
  def f(x):
    return rules.constrain(x * 2, ("batch", "length", "embed"))

  with jax.set_mesh(mesh):
    y = f(x)
  assert y.sharding.spec == P("data", "context")
  with pytest.raises(ValueError, match="one logical name per dim"):
    rules.constrain(x, ("batch",), mesh=mesh)


def test_constrain_follows_the_active_rules_and_can_skip_indivisible_dims():
  mesh = make_mesh(MeshConfig(data=4, context=2))
  one_token = jnp.ones((8, 1, 2))  # a decode step: length 1 on a context axis of 2

  @jax.jit
  def f(x):
    return rules.constrain(x * 2, ("batch", "length", "embed"), skip_indivisible=True)

  with jax.set_mesh(mesh):
    assert f(one_token).sharding.spec == P("data")
    with pytest.raises(ValueError, match=r"dimension 1 \('length'\) of size 1 is not divisible"):
      jax.jit(lambda x: rules.constrain(x, ("batch", "length", "embed")))(one_token)
    # Rules set by use_rules are the default while tracing; restored afterwards.
    with rules.use_rules({**dict(rules.DEFAULT_RULES), "batch": "context", "length": None}):
      g = jax.jit(lambda x: rules.constrain(x * 3, ("batch", "length", "embed")))
      assert g(jnp.ones((8, 4, 2))).sharding.spec == P("context")
  assert rules.current_rules() == rules.DEFAULT_RULES


def test_parallel_config_from_dict():
  from k3jax.parallel.config import ParallelConfig  # pylint: disable=g-import-not-at-top
  pconf = ParallelConfig.from_dict({"mesh": {"data": -1, "expert": 2}, "dispatch_slot_factor": 2.0,
                                    "rules": {"batch": ["data", "expert"], "expert": "expert"}})
  assert dict(pconf.make_mesh().shape) == {"stage": 1, "data": 4, "fsdp": 1, "expert": 2,
                                           "context": 1}
  assert pconf.rules == (("batch", ("data", "expert")), ("expert", "expert"))
  assert ParallelConfig.from_dict(None).rules == rules.DEFAULT_RULES
  with pytest.raises(ValueError, match=r"unknown parallel config keys \['tensor'\]"):
    ParallelConfig.from_dict({"tensor": 2})
  with pytest.raises(ValueError, match="dispatch_slot_factor=-1"):
    ParallelConfig.from_dict({"dispatch_slot_factor": -1})
  with pytest.raises(ValueError, match="'parallel.capacity_factor' was renamed "
                                       "'parallel.dispatch_slot_factor'"):
    ParallelConfig.from_dict({"capacity_factor": 2.0})
  assert pconf.dispatch_slot_factor == 2.0
  assert pconf.expert_parallel(2).dispatch_slot_factor == 2.0
  assert pconf.expert_parallel(1) is None
