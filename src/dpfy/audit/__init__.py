"""Privacy audits: empirical lower bounds beside the claimed epsilon, and record-and-replay checks.

An accountant's epsilon is an *upper* bound that holds if the code does what the ledger says.
An audit measures a *lower* bound from attacks on the real release path; a lower bound above
the claim proves a bug (at the stated confidence), one below it proves nothing more than that
this attack did not find one. Modules:

* :mod:`~dpfy.audit.stats` - Clopper-Pearson bounds, the threshold-test epsilon bound (both
  orientations, threshold chosen on a held-out half or from a fixed grid with a union bound),
  the Gaussian-DP mu of a test, and the one-run bound of Steinke, Nasr, Jagielski 2023.
* :mod:`~dpfy.audit.fdp` - the f-DP (Gaussian) one-run bound of Mahloujifar, Melis,
  Chaudhuri 2024 from the same counts.
* :mod:`~dpfy.audit.onerun` - the one-run audit of a real ``dpfy train`` run (canaries with
  secret coins in the training set, black-box and white-box scores).
* :mod:`~dpfy.audit.canary` - white-box gradient canaries on
  :class:`~dpfy.training.PrivateGradient` and the queries (Nasr et al. 2023), and the one-run
  audit of one release.
* :mod:`~dpfy.audit.replay` - gray-box record-and-replay checks (Cebere et al. 2026): two
  neighbouring batches, identical randomness, and what entered the noise compared with what the
  ledger declares.
* :mod:`~dpfy.audit.probes` - the replay on a probe model of each layer type a run recorded.
* :mod:`~dpfy.audit.counts` - the ledger's steps and releases against the sampler's plan and
  the run's own step count; the epsilon its writer recorded against its lines.
* :mod:`~dpfy.audit.realmodel` - the noise on every tensor of the run's own model.
* :mod:`~dpfy.audit.keys` - the run's key commitments against the local key registry.
* :mod:`~dpfy.audit.selftests` - white-box self-tests of one process's DP-SGD steps and the
  distributed (noise once across ranks), federated (one release per round) and
  correlated-noise (``C W`` white) releases; independent noise is also tested step to step.
* :mod:`~dpfy.audit.run` - ``dpfy audit RUN_DIR``: the audit of a run's configuration and its
  section of the report.
"""

from dpfy.audit.canary import CanaryAudit, OneRunAudit, canary_audit, one_run_audit
from dpfy.audit.selftests import (
    SelfTest,
    correlated_selftest,
    distributed_selftest,
    federated_selftest,
    sharded_selftest,
)

__all__ = [
    "canary_audit",
    "CanaryAudit",
    "one_run_audit",
    "OneRunAudit",
    "SelfTest",
    "correlated_selftest",
    "distributed_selftest",
    "sharded_selftest",
    "federated_selftest",
]
