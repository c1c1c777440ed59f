"""DP learning from pretrained features (Mehta et al. 2023): DP-LS, DP-Newton, DP-FC, DP-Adam.

Torch is needed here (``import dpfy`` and ``dpfy.accounting`` stay torch-free). The functional
algorithms live in :mod:`dpfy.features.algorithms`, exact accounting and calibration in
:mod:`dpfy.features.accounting`, the chunked sufficient statistics in :mod:`dpfy.features.stats`,
scikit-learn-style estimators in :mod:`dpfy.features.estimators` and feature extraction (cached)
in :mod:`dpfy.features.extract` (imported on demand; it needs the ``features`` extra).
"""

from dpfy.features.accounting import gdp_figures
from dpfy.features.estimators import (
    DPAdamClassifier,
    DPFeatureCovarianceClassifier,
    DPLeastSquaresClassifier,
    DPNewtonClassifier,
)

__all__ = [
    "DPLeastSquaresClassifier",
    "DPNewtonClassifier",
    "DPFeatureCovarianceClassifier",
    "DPAdamClassifier",
    "gdp_figures",
]
