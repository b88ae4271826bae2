"""pallas_kernels.tools.device_profile: kernel times from a trace's device streams."""
import jax
import jax.numpy as jnp

from pallas_kernels.tools import device_profile


def _meta(pid, name):
  return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def test_summarize_trace_sums_device_events_by_name_per_call():
  events = [
      _meta(1, "/host:CPU"), _meta(7, "/device:GPU:0"),
      {"ph": "X", "pid": 1, "tid": 0, "name": "gmm", "dur": 9000.0},   # host: ignored
      {"ph": "X", "pid": 7, "tid": 3, "name": "gmm", "dur": 500.0},
      {"ph": "X", "pid": 7, "tid": 3, "name": "gmm", "dur": 700.0},
      {"ph": "X", "pid": 7, "tid": 4, "name": "loop_fusion", "dur": 100.0},
      {"ph": "X", "pid": 7, "tid": 4, "name": "loop_fusion", "dur": 100.0},
      {"ph": "X", "pid": 7, "tid": 4, "name": "tgmm", "dur": 1600.0},
  ]
  rows = device_profile.summarize_trace(events, calls=2)
  assert rows == [("tgmm", 0.8, 0.5), ("gmm", 0.6, 1.0), ("loop_fusion", 0.1, 1.0)]


def test_kernel_ms_on_the_cpu_has_no_device_streams():
  assert device_profile.kernel_ms(jax.jit(lambda a: a * 2), jnp.ones(4), calls=2) == []
