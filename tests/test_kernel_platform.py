"""Where each Pallas kernel family runs interpreted (`pallas_kernels.platform`)."""
import jax
import pytest

from pallas_kernels import platform


def test_each_family_interprets_off_its_lowerings():
  table = {(family, p): platform.interprets(family, p)
           for family in ("kda", "kda_decode", "gmm") for p in ("cpu", "gpu", "tpu")}
  assert table == {
      ("kda", "cpu"): True, ("kda", "gpu"): False, ("kda", "tpu"): False,
      ("kda_decode", "cpu"): True, ("kda_decode", "gpu"): False, ("kda_decode", "tpu"): True,
      ("gmm", "cpu"): True, ("gmm", "gpu"): False, ("gmm", "tpu"): True,
  }
  assert platform.interprets("kda") == platform.interprets("kda", jax.default_backend())
  with pytest.raises(ValueError, match="kernel family 'mgpu'"):
    platform.interprets("mgpu")
