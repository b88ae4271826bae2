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


def routed_load(routed_tk: jax.Array, num_experts: int,
                valid_t: jax.Array | None = None) -> jax.Array:
  """Assignments per expert of a router's own top-k [T, k], over the unmasked tokens
  (`valid_t` [T] bool; None: all). [E] float32."""
  if valid_t is None:
    return jnp.bincount(routed_tk.reshape(-1), length=num_experts).astype(jnp.float32)
  return expert_load(routed_tk, jnp.broadcast_to(valid_t[:, None], routed_tk.shape), num_experts)


def token_mean(x_t: jax.Array, valid_t: jax.Array | None = None) -> jax.Array:
  """Mean over the leading (token) axis of float `x_t` [T, ...], over the unmasked tokens
  only when `valid_t` [T] bool is given (0 when none is)."""
  if valid_t is None:
    return jnp.mean(x_t, axis=0)
  mask = valid_t.reshape(valid_t.shape + (1,) * (x_t.ndim - 1))
  count = jnp.maximum(jnp.sum(valid_t.astype(jnp.float32)), 1.0)
  return jnp.sum(jnp.where(mask, x_t, 0.0), axis=0) / count


def _slot_fraction(flag_tk: jax.Array, valid_t: jax.Array | None) -> jax.Array:
  """The fraction of [T, k] slots where `flag_tk` holds, over the unmasked tokens."""
  if valid_t is None:
    return jnp.mean(flag_tk.astype(jnp.float32))
  return jnp.mean(token_mean(flag_tk.astype(jnp.float32), valid_t))


def routing_stats(indices_tk: jax.Array, kept_tk: jax.Array, routed_tk: jax.Array,
                  num_experts: int, aux_loss: jax.Array | None = None,
                  valid_t: jax.Array | None = None) -> dict:
  """The stats dict every router returns.

  Args:
    indices_tk: [T, k] final expert ids.
    kept_tk: [T, k] bool, False where the capacity dropped the assignment.
    routed_tk: [T, k] the router's preferred ids before any capacity limit.
    num_experts: E.
    aux_loss: scalar loss to report, zero when None.
    valid_t: [T] bool or None: only the True tokens count (their `kept_tk`
      must already be False elsewhere).

  Returns:
    dict of float32: load [E] (kept), max_vio, load_cv and drop_fraction of
    the kept loads, max_vio_routed of the preferred choice (what a dropless
    layer would see), reassigned_fraction (kept assignments outside the
    token's preferred top-k, i.e. moved there by the capacity), and aux_loss.
  """
  load_e = expert_load(indices_tk, kept_tk, num_experts)
  counted_tk = (jnp.ones_like(kept_tk) if valid_t is None
                else jnp.broadcast_to(valid_t[:, None], kept_tk.shape))
  routed_e = expert_load(routed_tk, counted_tk, num_experts)
  preferred_tk = jnp.any(indices_tk[:, :, None] == routed_tk[:, None, :], axis=-1)
  return {
      "load": load_e,
      "max_vio": max_violation(load_e),
      "max_vio_routed": max_violation(routed_e),
      "load_cv": coefficient_of_variation(load_e),
      "drop_fraction": 1.0 - _slot_fraction(kept_tk, valid_t),
      "reassigned_fraction": _slot_fraction(kept_tk & ~preferred_tk, valid_t),
      "aux_loss": (jnp.zeros((), jnp.float32) if aux_loss is None
                   else aux_loss.astype(jnp.float32)),
  }
