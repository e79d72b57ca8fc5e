"""RAM budget and thermal state -> decisions the engine applies (admit, spill, reject, slow down)."""

from .activations import Activations, prefill_activations
from .budget import BudgetTooSmall, MemoryPlan, parse_size
from .governor import Admission, Governor, MemoryReading, Sensors, SystemSensors, Throttle, backend_limits
from .setup import default_budget, governor_for, plan_for
from .thermal import STATES, read_thermal_state

__all__ = ["Activations", "prefill_activations", "BudgetTooSmall", "MemoryPlan", "parse_size", "Admission", "Governor",
           "MemoryReading", "Sensors", "SystemSensors", "Throttle", "backend_limits", "STATES", "read_thermal_state",
           "default_budget", "governor_for", "plan_for"]
