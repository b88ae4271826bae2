"""The KDA decode step (pallas_kernels.kda.decode) against the naive recurrence."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import decode, reference
from pallas_kernels.tools import decode_ir
from tests.kda_inputs import RTOL, make_inputs, rel_err, rel_max

F32_TOL = RTOL[jnp.dtype(jnp.float32)]


def _naive(x, h0):
  """The f32 token loop from the same (possibly bf16) inputs."""
  f32 = [a.astype(jnp.float32) for a in x.args()]
  return jax.jit(functools.partial(reference.naive_recurrent_kda, output_final_state=True))(
      *f32, initial_state=h0)


class DecodeChecks:
  """Every decode option against the naive f32 recurrence; subclasses pick the platform."""
  interpret: bool
  heads, dk, dv = 2, 16, 16
  batch = 3

  def _step(self, implementation, **kw):
    if implementation == "pallas":
      kw = dict(kw, interpret=self.interpret)
    return jax.jit(functools.partial(decode.kda_decode_step, implementation=implementation,
                                     **kw))

  def _inputs(self, seed, t_new, **kw):
    return make_inputs(seed, batch=self.batch, seq_len=t_new, heads=self.heads, dk=self.dk,
                       dv=self.dv, **kw)

  @pytest.mark.parametrize("implementation", ["pallas", "fused"])
  @pytest.mark.parametrize("t_new", [1, 3, 16])
  @pytest.mark.parametrize("gate", ["at", "mixed"])
  def test_matches_naive_recurrence(self, implementation, t_new, gate):
    """f32, gates at the bound or mixed, T_new 1, 3 (not a power of two) and the maximum."""
    x = self._inputs(10 + t_new, t_new, gate=gate)
    o, s = self._step(implementation)(*x.args(), x.h0)
    o_ref, s_ref = _naive(x, x.h0)
    assert o.shape == o_ref.shape and o.dtype == jnp.float32
    assert s.shape == x.h0.shape and s.dtype == jnp.float32
    assert rel_max(o, o_ref) < F32_TOL, rel_max(o, o_ref)
    assert rel_max(s, s_ref) < F32_TOL, rel_max(s, s_ref)

  @pytest.mark.parametrize("implementation", ["pallas", "fused"])
  def test_scalar_gate_and_custom_scale(self, implementation):
    """GDN gates [B, T, H] and a scale other than K ** -0.5."""
    x = self._inputs(20, 2, scalar_gate=True)
    o, s = self._step(implementation, scale=0.3)(*x.args(), x.h0)
    f32 = [a.astype(jnp.float32) for a in x.args()]
    o_ref, s_ref = reference.naive_recurrent_kda(*f32, scale=0.3, initial_state=x.h0,
                                                 output_final_state=True)
    assert rel_max(o, o_ref) < F32_TOL
    assert rel_max(s, s_ref) < F32_TOL

  @pytest.mark.parametrize("implementation", ["pallas", "fused"])
  def test_bf16_inputs(self, implementation):
    """bf16 q/k/v/beta: o in bf16 (its rounding), the state still exact f32."""
    x = self._inputs(21, 2, dtype=jnp.bfloat16)
    o, s = self._step(implementation)(*x.args(), x.h0)
    o_ref, s_ref = _naive(x, x.h0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(o, o_ref, jnp.bfloat16) < RTOL[jnp.dtype(jnp.bfloat16)]
    assert rel_max(s, s_ref) < F32_TOL

  def test_pallas_tilings(self):
    """V split over several programs (block_v < V) and another warp count."""
    x = self._inputs(22, 3, gate="mixed")
    o_ref, s_ref = _naive(x, x.h0)
    for block_v in (8, self.dv):
      o, s = self._step("pallas", block_v=block_v, num_warps=2 if self.interpret else 8)(
          *x.args(), x.h0)
      assert rel_max(o, o_ref) < F32_TOL, block_v
      assert rel_max(s, s_ref) < F32_TOL, block_v

  @pytest.mark.parametrize("implementation", ["pallas", "fused"])
  def test_chained_steps_equal_one_pass(self, implementation):
    """Steps of 1, 3 and 2 tokens carry the state like the naive loop over all 6."""
    x = self._inputs(23, 6, gate="mixed")
    step = self._step(implementation)
    state, outs = x.h0, []
    for lo, hi in ((0, 1), (1, 4), (4, 6)):
      o, state = step(*(a[:, lo:hi] for a in x.args()), state)
      outs.append(o)
    o_ref, s_ref = _naive(x, x.h0)
    assert rel_max(jnp.concatenate(outs, axis=1), o_ref) < F32_TOL
    assert rel_max(state, s_ref) < F32_TOL

  @pytest.mark.parametrize("implementation", ["pallas", "fused"])
  def test_causal(self, implementation):
    """Changing token 2's inputs leaves outputs 0..1 bit-identical and changes output 2."""
    x = self._inputs(24, 4)
    step = self._step(implementation)
    o1, _ = step(*x.args(), x.h0)
    v2 = x.v.at[:, 2:].add(1.0)
    g2 = x.g.at[:, 2:].set(-0.1)
    o2, _ = step(x.q, x.k, v2, g2, x.beta, x.h0)
    np.testing.assert_array_equal(np.asarray(o1[:, :2]), np.asarray(o2[:, :2]))
    assert not np.allclose(np.asarray(o1[:, 2:]), np.asarray(o2[:, 2:]))


class TestDecodeInterpret(DecodeChecks):
  interpret = True

  def test_naive_option_is_the_reference(self):
    x = self._inputs(30, 2)
    o, s = decode.kda_decode_step(*x.args(), x.h0, implementation="naive")
    o_ref, s_ref = _naive(x, x.h0)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))

  def test_auto_picks_the_kernel_for_multi_token_steps_and_wide_batches_on_the_gpu(self):
    """What measured fastest: the kernel from 2 tokens; for one token from B * H = 1024
    states (B 64 at H 16), the fused step below."""
    for t_new in (2, 4, 16):
      assert decode.resolve_decode("auto", t_new, 128, platform="gpu", states=16) == "pallas"
    wide = decode.MIN_KERNEL_STATES_ONE_TOKEN
    assert wide == 64 * 16
    assert decode.resolve_decode("auto", 1, 128, platform="gpu", states=wide) == "pallas"
    assert decode.resolve_decode("auto", 1, 128, platform="gpu", states=wide - 1) == "fused"
    assert decode.resolve_decode("auto", 1, 128, platform="gpu") == "fused"
    assert decode.resolve_decode("auto", None, platform="gpu") == "fused"
    assert decode.resolve_decode("auto", 4, 96, platform="gpu") == "fused"   # Triton tiles
    assert decode.resolve_decode("auto", 1, 96, platform="gpu", states=wide) == "fused"
    for platform in ("cpu", "tpu"):
      assert decode.resolve_decode("auto", 4, 128, platform=platform) == "fused"
      assert decode.resolve_decode("auto", 1, 128, platform=platform, states=wide) == "fused"
    assert decode.resolve_decode("naive", 4, platform="gpu") == "naive"
    assert decode.resolve_decode("fused", 1, 128, platform="gpu", states=wide) == "fused"

  def test_bad_arguments(self):
    x = self._inputs(31, 2)
    args = x.args()
    with pytest.raises(ValueError, match="1 to 16 new tokens, got T_new=17"):
      y = self._inputs(31, 17)
      decode.kda_decode_step(*y.args(), y.h0)
    with pytest.raises(TypeError, match="state must be float32.*bfloat16"):
      decode.kda_decode_step(*args, x.h0.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="state must be the"):
      decode.kda_decode_step(*args, None)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\]"):
      decode.kda_decode_step(*args, x.h0[:1])
    with pytest.raises(ValueError, match="one of \\('pallas', 'fused', 'naive'\\), got 'scan'"):
      decode.kda_decode_step(*args, x.h0, implementation="scan")
    with pytest.raises(ValueError, match="block_v must be a power of two dividing V=16, got 3"):
      decode.kda_decode_step(*args, x.h0, implementation="pallas", block_v=3, interpret=True)
    with pytest.raises(ValueError, match="block_v / num_warps tune the 'pallas'"):
      decode.kda_decode_step(*args, x.h0, implementation="fused", block_v=8)
    if jax.default_backend() == "cpu":
      with pytest.raises(ValueError, match="GPU or with interpret=True"):
        decode.kda_decode_step(*args, x.h0, implementation="pallas")
    y = make_inputs(32, batch=1, seq_len=1, heads=1, dk=12, dv=8)
    with pytest.raises(ValueError, match="K a power of two .* K=12"):
      decode.kda_decode_step(*y.args(), y.h0, implementation="pallas", interpret=True)

  def test_roofline(self):
    assert decode.state_bytes(8, 16, 128, 128) == 2 * 4 * 8 * 16 * 128 * 128
    assert decode.state_roofline_s(1, 16, 128, 128, bandwidth_bytes_s=1e12) == pytest.approx(
        2 * 4 * 16 * 128 * 128 / 1e12)

  @pytest.mark.parametrize("t_new,block_v,num_warps", [(1, None, None), (5, 64, 8)])
  def test_lowers_for_cuda_in_place(self, tmp_path, t_new, block_v, num_warps):
    """The kernel lowers to Triton IR for sm_90 on this machine, the state aliased in place."""
    entry = decode_ir.lower_decode_kernel(str(tmp_path), batch=2, heads=4, dk=128, dv=128,
                                          t_new=t_new, block_v=block_v, num_warps=num_warps)
    assert entry["name"] == "kda_decode_step"
    assert entry["num_warps"] == (num_warps or decode.DEFAULT_NUM_WARPS)
    assert entry["aliases"] == 1
    ir = open(entry["file"]).read()
    assert "tt.func" in ir and "tt.dot" not in ir  # matvecs: multiply and reduce
    tile = f"tensor<128x{block_v or decode.DEFAULT_BLOCK_V}xf32>"
    assert tile in ir
    assert ir.count("tt.store") == t_new + 1  # one output row per token, the state once


@pytest.mark.gpu
class TestDecodeGpu(DecodeChecks):
  interpret = False
  heads, dk, dv = 16, 128, 128
  batch = 8

  def test_donated_state_is_updated_in_place(self):
    """With the state donated, the compiled step holds no copy of it (the aliased output)."""
    x = self._inputs(40, 1)
    step = jax.jit(functools.partial(decode.kda_decode_step, implementation="pallas"),
                   donate_argnums=5)
    hlo = step.lower(*x.args(), x.h0).compile().as_text()
    shape = "f32[{},{},{},{}]".format(*x.h0.shape)
    copies = [line for line in hlo.splitlines() if " copy(" in line and shape in line]
    assert not copies, copies
