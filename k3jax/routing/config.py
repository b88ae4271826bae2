"""Router configuration shared by every router family."""
import dataclasses

ROUTER_NAMES = (
    "quantile",
    "quantile_lagged",
    "bias_sign",
    "aux_loss",
    "expert_choice",
    "topk",
)
QUANTILE_IMPLS = ("exact", "radix", "histogram")
STATEFUL_ROUTERS = ("quantile_lagged", "bias_sign")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """Which router to run and its knobs.

  Each check's message starts with the field it names (`name='x'; allowed ...`).

  Attributes:
    name: one of ROUTER_NAMES. "topk" is plain top-k with no balancing.
    capacity_factor: each expert keeps at most
      ceil(capacity_factor * T * k / E) assignments per batch; overflow moves to
      the token's next choice with room, else it is dropped. None means
      dropless (no capacity). expert_choice needs a number.
    quantile_impl: "exact" (top_k per expert), "radix" (the same thresholds
      by a radix select over the float bits: four histogram passes, no
      sort) or "histogram" (fixed bins per expert over its value range;
      approximate).
    num_bins: bins per expert for the histogram quantiles.
    bias_update_rate: the step u of bias_sign, b_e += u * sign(mean - load_e).
    aux_loss_coef: alpha of the Switch/GShard loss alpha * E * sum_e f_e P_e.
    overflow_choices: how many choices past the k-th a token may fall back to
      when its preferred experts are full; None means k.
  """

  name: str = "quantile"
  capacity_factor: float | None = 1.25
  quantile_impl: str = "radix"
  num_bins: int = 1000
  bias_update_rate: float = 1e-3
  aux_loss_coef: float = 1e-2
  overflow_choices: int | None = None

  def __post_init__(self):
    if self.name not in ROUTER_NAMES:
      raise ValueError(f"name={self.name!r}; allowed: {ROUTER_NAMES}")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
      raise ValueError(
          f"capacity_factor={self.capacity_factor!r}; must be > 0 "
          "or None (dropless)")
    if self.name == "expert_choice" and self.capacity_factor is None:
      raise ValueError(
          "capacity_factor=None (dropless) does not serve name='expert_choice', "
          "which needs a capacity_factor > 0")
    if self.quantile_impl not in QUANTILE_IMPLS:
      raise ValueError(
          f"quantile_impl={self.quantile_impl!r}; allowed: "
          f"{QUANTILE_IMPLS}")
    if not (isinstance(self.num_bins, int) and self.num_bins >= 2):
      raise ValueError(f"num_bins={self.num_bins!r}; must be an int >= 2")
    if not self.bias_update_rate >= 0:
      raise ValueError(
          f"bias_update_rate={self.bias_update_rate!r}; must be >= 0")
    if not self.aux_loss_coef >= 0:
      raise ValueError(
          f"aux_loss_coef={self.aux_loss_coef!r}; must be >= 0")
    if self.overflow_choices is not None and not (
        isinstance(self.overflow_choices, int) and self.overflow_choices >= 0):
      raise ValueError(
          f"overflow_choices={self.overflow_choices!r}; must be an "
          "int >= 0 or None")

  @property
  def stateful(self) -> bool:
    """Whether the router carries a per-expert bias across batches."""
    return self.name in STATEFUL_ROUTERS
