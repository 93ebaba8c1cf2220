"""Convergence-aware checkpoint scheduling: when should a training job checkpoint?

``young_daly`` gives the classic periodic intervals; ``solve`` plans checkpoint
iterations for a horizon, weighing lost work by the progress it represented (a
fitted loss curve) and by the chance the job is still wanted (termination
models), and returns a :class:`Plan`; ``simulate`` scores any schedule by Monte
Carlo, independently of the solver's cost model. The package does not take
checkpoints itself.
"""

from .curves import FAMILIES, FittedCurve, fit_curve, fit_exponential_no_offset
from .failures import Exponential, FailureModel, Piecewise, Weibull
from .intervals import lambert_w0, lambert_w0_branch, young_daly
from .plan import Plan
from .simulate import simulate
from .solver import METHODS, score, solve
from .termination import Empirical, ExponentialTermination, NoTermination, Rungs, Termination
from .weights import POLICIES, Accounting

__all__ = [
    "Accounting", "Empirical", "Exponential", "ExponentialTermination", "FAMILIES",
    "FailureModel", "FittedCurve", "METHODS", "NoTermination", "POLICIES", "Piecewise",
    "Plan", "Rungs", "Termination", "Weibull", "fit_curve", "fit_exponential_no_offset",
    "lambert_w0", "lambert_w0_branch", "score", "simulate", "solve", "young_daly",
]
