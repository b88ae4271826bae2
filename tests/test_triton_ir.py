"""The CPU-side Triton IR capture behind experiments/bench/inspect_triton.py (no GPU, no triton)."""
import json
from pathlib import Path

from pallas_kernels.tools import triton_ir


def test_captures_every_kernel_of_the_training_step(tmp_path):
  entries = triton_ir.lower_kernels(str(tmp_path), (1, 128, 2, 64),
                                         overrides={"num_warps": (("intra_bwd_k", 8),)})
  names = [e["name"] for e in entries]
  # The dense path clamps the traced gates inside its two cumsum kernels.
  assert names == ["kda_clamped_cumsum", "kda_intra_fwd", "kda_state_rec", "kda_output_fwd",
                   "kda_state_bwd", "kda_intra_bwd_cc", "kda_intra_bwd_k",
                   "kda_clamped_cumsum_bwd"]
  warps = {e["name"]: e["num_warps"] for e in entries}
  assert warps["kda_intra_bwd_k"] == 8          # the override
  assert warps["kda_intra_bwd_cc"] == 4         # a default
  assert json.loads((tmp_path / "kernels.json").read_text()) == entries
  ir = Path(entries[6]["file"]).read_text()
  assert "tt.dot" in ir and "tt.func" in ir
  assert "loc(" not in ir and "#loc" not in ir


def test_fused_gate_replaces_both_cumsums(tmp_path):
  """gate_activation: the gate kernels take the plain cumsums' places; the rest is unchanged."""
  entries = triton_ir.lower_kernels(str(tmp_path), (1, 128, 2, 64),
                                    fused_gate=True)
  assert [e["name"] for e in entries] == [
      "kda_gate_cumsum", "kda_intra_fwd", "kda_state_rec", "kda_output_fwd", "kda_state_bwd",
      "kda_intra_bwd_cc", "kda_intra_bwd_k", "kda_gate_cumsum_bwd"]


def test_strip_locations_and_sass_counts():
  asm = ('#loc = loc(unknown)\n'
         '%0 = arith.addf %a, %b : f32 loc(#loc3)\n'
         '%1 = arith.mulf %0, %0 : f32 loc(callsite("f"("x.py":1:2) at #loc4))\n')
  assert triton_ir.strip_locations(asm) == (
      "%0 = arith.addf %a, %b : f32\n%1 = arith.mulf %0, %0 : f32\n")
  sass = ("        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;\n"
          "        /*0020*/               @P0 LDL R4, [R1] ;\n"
          "        /*0030*/                   MUFU.EX2 R2, R3 ;\n"
          "        /*0040*/                   BAR.SYNC 0x0 ;\n")
  assert triton_ir.sass_counts(sass) == {"BAR": 2, "LDL": 1, "MUFU": 1}


def test_pairwise_diagonal_lowers_to_16_bit_tensor_core_products(tmp_path):
  """The pairwise diagonal lowers for CUDA with no position loop and no f32
  product: every tt.dot of its intra kernels takes bf16 operands (D = 128,
  where the intra backward's products are bf16 for dense too)."""
  entries = triton_ir.lower_kernels(str(tmp_path), (1, 128, 2, 128), diagonal="pairwise")
  intra = {e["name"]: Path(e["file"]).read_text() for e in entries if "intra" in e["name"]}
  assert set(intra) == {"kda_intra_fwd", "kda_intra_bwd_cc", "kda_intra_bwd_k"}
  for name, ir in intra.items():
    dots = [line for line in ir.splitlines() if "tt.dot " in line]
    assert dots, name
    assert all(line.count("xbf16>") == 2 for line in dots), (name, dots)
    assert "scf.for" not in ir, name


def test_lower_program_takes_any_pallas_program(tmp_path):
  """The grouped weight gradient with [128, 256] result tiles at 8 warps: one
  kernel, the launch options of its config, a [128, 256] f32 accumulator."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.gmm import api as gmm_api
  from pallas_kernels.gmm import layout
  from pallas_kernels.gmm.config import default_config

  cfg = default_config(jnp.bfloat16)  # [128, 256] result tiles at 8 warps
  rows, k, n, groups = 1024, 256, 512, 4

  def wgrad(x, y, starts, sizes):
    tiles = layout.tile_map(starts, sizes, rows, cfg.block_m)
    return gmm_api.tgmm(x, y, tiles, config=cfg, interpret=False)

  spec = jax.ShapeDtypeStruct
  entries = triton_ir.lower_program(str(tmp_path), wgrad, (
      spec((rows, k), jnp.bfloat16), spec((rows, n), jnp.bfloat16),
      spec((groups,), jnp.int32), spec((groups,), jnp.int32)))
  assert [(e["name"], e["num_warps"], e["num_stages"]) for e in entries] == [
      ("tgmm", 8, cfg.wgrad_stages)]
  assert "tensor<128x256xf32" in Path(entries[0]["file"]).read_text()


def test_inspect_triton_lowers_the_routed_experts(tmp_path):
  """`inspect_triton.py --op=moe`: the routed experts' forward+VJP, four products and two
  weight gradients, with the --gmm_config fields in their launch options."""
  import os
  import subprocess
  import sys
  root = Path(__file__).resolve().parents[1]
  res = subprocess.run(
      [sys.executable, str(root / "experiments" / "bench" / "inspect_triton.py"), "--op=moe",
       f"--out={tmp_path}", "--moe_shape=1,256,64,4,2,64", "--gmm_config=wgrad_warps=8"],
      capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert res.returncode == 0, res.stderr[-3000:]
  entries = json.loads((tmp_path / "kernels.json").read_text())
  assert sorted(e["name"] for e in entries) == ["gmm"] * 4 + ["tgmm"] * 2
  assert {e["num_warps"] for e in entries if e["name"] == "tgmm"} == {8}
  bad = subprocess.run(
      [sys.executable, str(root / "experiments" / "bench" / "inspect_triton.py"), "--op=moe",
       f"--out={tmp_path}", "--gmm_config=wgrad_block_n=96"],
      capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert bad.returncode != 0 and "wgrad_block_n=96" in bad.stderr
