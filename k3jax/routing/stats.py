"""Balance metrics of a routing decision."""
import jax
import jax.numpy as jnp


def expert_load(indices_tk: jax.Array, kept_tk: jax.Array, num_experts: int) -> jax.Array:
  """Kept assignments per expert.

  Args:
    indices_tk: [T, k] int expert ids.
    kept_tk: [T, k] bool, False for dropped assignments.
    num_experts: E.

  Returns:
    load_e: [E] float32.
  """
  ids = jnp.where(kept_tk, indices_tk, num_experts).reshape(-1)
  return jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.float32)


def max_violation(load_e: jax.Array) -> jax.Array:
  """MaxVio = max_e load_e / mean_e load_e - 1 (0 for an empty batch). Scalar f32."""
  mean = jnp.mean(load_e)
  return jnp.where(mean > 0, jnp.max(load_e) / jnp.maximum(mean, 1e-30) - 1.0, 0.0)


def coefficient_of_variation(load_e: jax.Array) -> jax.Array:
  """std_e(load) / mean_e(load) (0 for an empty batch). Scalar f32."""
  mean = jnp.mean(load_e)
  return jnp.where(mean > 0, jnp.std(load_e) / jnp.maximum(mean, 1e-30), 0.0)


def routing_stats(indices_tk: jax.Array, kept_tk: jax.Array, routed_tk: jax.Array,
                  num_experts: int, aux_loss: jax.Array | None = None) -> dict:
  """The stats dict every router returns.

  Args:
    indices_tk: [T, k] final expert ids.
    kept_tk: [T, k] bool, False where the capacity dropped the assignment.
    routed_tk: [T, k] the router's preferred ids before any capacity limit.
    num_experts: E.
    aux_loss: scalar loss to report, zero when None.

  Returns:
    dict of float32: load [E] (kept), max_vio, load_cv and drop_fraction of
    the kept loads, max_vio_routed of the preferred choice (what a dropless
    layer would see), reassigned_fraction (kept assignments outside the
    token's preferred top-k, i.e. moved there by the capacity), and aux_loss.
  """
  load_e = expert_load(indices_tk, kept_tk, num_experts)
  routed_e = expert_load(routed_tk, jnp.ones_like(kept_tk), num_experts)
  preferred_tk = jnp.any(indices_tk[:, :, None] == routed_tk[:, None, :], axis=-1)
  return {
      "load": load_e,
      "max_vio": max_violation(load_e),
      "max_vio_routed": max_violation(routed_e),
      "load_cv": coefficient_of_variation(load_e),
      "drop_fraction": 1.0 - jnp.mean(kept_tk.astype(jnp.float32)),
      "reassigned_fraction": jnp.mean((kept_tk & ~preferred_tk).astype(jnp.float32)),
      "aux_loss": (jnp.zeros((), jnp.float32) if aux_loss is None
                   else aux_loss.astype(jnp.float32)),
  }
