"""``plan_remat``: choose the cheapest exact remat policy that fits a memory budget,
by measuring every per-block option once and solving exactly (see
docs/planning.md)."""

from ._layout import Layout
from ._measure import activation_bytes
from ._offload import OffloadOptions
from ._report import ParetoRow, ParetoTable
from ._space import Option
from .forecast import Forecast, PolicyForecast, forecast_remat
from .plan import InfeasibleBudgetError, Measured, PlanMismatchError, RematPlan, plan_remat

__all__ = [
    "plan_remat",
    "forecast_remat",
    "Forecast",
    "PolicyForecast",
    "Layout",
    "RematPlan",
    "Option",
    "OffloadOptions",
    "Measured",
    "ParetoTable",
    "ParetoRow",
    "InfeasibleBudgetError",
    "PlanMismatchError",
    "activation_bytes",
]
