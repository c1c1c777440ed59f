"""DP learning from pretrained features (Mehta et al. 2023): DP-LS, DP-Newton, DP-FC, DP-Adam.

Torch is needed here (``import dpfy`` and ``dpfy.accounting`` stay torch-free). The functional
algorithms live in :mod:`dpfy.features.algorithms`, exact accounting and calibration in
:mod:`dpfy.features.accounting`, the chunked sufficient statistics in :mod:`dpfy.features.stats`,
scikit-learn-style estimators in :mod:`dpfy.features.estimators` and feature extraction (cached)
in :mod:`dpfy.features.extract` (imported on demand; it needs the ``features`` extra).
"""

from dpfy.features.accounting import (
    GDPFigures,
    gdp_delta,
    gdp_epsilon,
    gdp_figures,
    mu_for_target,
    noise_multipliers,
    paper_zcdp_rho,
)
from dpfy.features.algorithms import (
    Fitted,
    dp_adam,
    dp_feature_covariance,
    dp_least_squares,
    dp_newton,
)
from dpfy.features.estimators import (
    DPAdamClassifier,
    DPFeatureCovarianceClassifier,
    DPLeastSquaresClassifier,
    DPNewtonClassifier,
)
from dpfy.features.stats import SufficientStats, sufficient_statistics

__all__ = [
    "DPAdamClassifier",
    "DPFeatureCovarianceClassifier",
    "DPLeastSquaresClassifier",
    "DPNewtonClassifier",
    "Fitted",
    "GDPFigures",
    "SufficientStats",
    "dp_adam",
    "dp_feature_covariance",
    "dp_least_squares",
    "dp_newton",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_figures",
    "mu_for_target",
    "noise_multipliers",
    "paper_zcdp_rho",
    "sufficient_statistics",
]
