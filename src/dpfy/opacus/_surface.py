"""Every public name of Opacus 1.6, and what ``dpfy.opacus`` does with it.

:data:`SURFACE` maps each public Opacus module to its names (the ``__all__`` of the module, or
the classes and functions it defines when it has none): a name ``dpfy.opacus`` has is
``"=module:attribute"``, where it lives in dpfy; any other is refused with one line saying why
and what to use instead. :func:`install` makes every module of the table importable under
``dpfy.opacus`` (a module dpfy has as a file keeps its own names; the others are stub modules
made here), and gives each a module ``__getattr__`` that serves the table: a refused name
raises :class:`ImportError` with its line, so ``from dpfy.opacus.x import Name`` never ends in
Python's bare "cannot import name". ``docs/opacus_names.md`` is the table, generated from the
installed Opacus by ``benchmarks/opacus_names.py`` and checked by
``tests/opacus/test_opacus_surface.py``.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

from dpfy.opacus._compat import DISTRIBUTED

#: The Opacus release whose surface this follows.
OPACUS_VERSION = "1.6.0"

_GSM = (
    "dpfy never wraps the model nor stores per-example gradients on its parameters: "
    "PrivacyEngine.make_private returns your model itself (model._module is it too); "
    "per-example clipping in your own step is dpfy.training.PrivateGradient"
)
_RULE = (
    "per-layer rules are dpfy's own, registered by module type "
    "(dpfy.training.norms.registry.register_norm_rule)"
)
_PER_LAYER = (
    "per-layer clip norms are dpfy's NestedQuery with dpfy.training.PrivateGradient; "
    "dpfy.opacus clips flat (one norm per example)"
)
_ADAPTIVE = "adaptive clipping is dpfy's AdaptiveClipQuery (dpfy.queries) with PrivateGradient"
_SCHEDULE = (
    "the noise multiplier and clip norm are fixed for a dpfy.opacus run (calibrated to its "
    "budget); a schedule is a dpfy.training.PrivateGradient loop, whose ledger records each "
    "release's own noise"
)
_GDP = (
    "Opacus' GDP analysis is a central-limit estimate, not a bound: dpfy accounts with "
    "dpfy.accounting.epsilon(event, delta, 'pld')"
)
_PRV = (
    "Opacus' PRV internals are not reproduced: dpfy's PLD accountant gives the bound "
    "(dpfy.accounting.epsilon(event, delta, 'pld'); dpfy.opacus.accountants.PRVAccountant)"
)
_LOADER = (
    "Opacus' loader internals: make_private returns the DPDataLoader, whose batches dpfy's "
    "sampler draws (an empty Poisson draw is one weight-0 row)"
)
_SAMPLER = (
    "Poisson sampling is dpfy.sampling.PoissonSampler, which make_private draws with; its "
    "privacy event is recorded in the ledger"
)
_TORCH = "a helper of Opacus' internals; PyTorch has its own (torch.nn.Module, torch.func)"
_TEST = (
    "Opacus' per-example gradient test helpers; dpfy's exactness is tested against a "
    "per-example loop in its own suite (tests/training/test_layer_zoo.py)"
)
_VALIDATE = (
    "ModuleValidator.validate and fix cover every layer (dpfy.training.check_module and "
    "fix_module); new checks: dpfy.training.validate.register_module_check"
)
_LAYER = (
    "dpfy clips torch.nn.LSTM, GRU, RNN and MultiheadAttention as they are; "
    "dpfy.opacus.layers gives those classes"
)
_GHOST = (
    "ghost clipping is dpfy's default: make_private(grad_sample_mode='ghost') returns a "
    "criterion whose loss.backward() clips per example"
)
_FSDP = (
    "FSDP sharding is dpfy's own: dpfy.training.PrivateGradient with a Distributed "
    "(docs/architecture.md, 5.18)"
)
_BMM = (
    "BatchMemoryManager cuts the private loader itself (dpfy.opacus.utils."
    "batch_memory_manager.BatchMemoryManager)"
)

_ERR = "=dpfy.training:UnsupportedModuleError"
_DPLSTM = "=torch.nn:LSTM"


def _same(names: str, target: str) -> dict[str, str]:
    return {n: target for n in names.split()}


#: Opacus 1.6 module -> {name: "=dpfy module:attribute" or the reason it is refused}.
SURFACE: dict[str, dict[str, str]] = {
    "opacus": {
        "PrivacyEngine": "=dpfy.opacus.privacy_engine:PrivacyEngine",
        "GradSampleModule": _GSM, "GradSampleModuleFastGradientClipping": _GHOST,
        "utils": "=dpfy.opacus:utils", "__version__": "=dpfy.opacus._surface:OPACUS_VERSION",
    },
    "opacus.accountants": {
        **{n: f"=dpfy.opacus._accountants:{n}" for n in (
            "GaussianAccountant", "IAccountant", "PRVAccountant", "RDPAccountant",
            "create_accountant", "register_accountant")},
    },
    "opacus.accountants.accountant": {"IAccountant": "=dpfy.opacus._accountants:IAccountant"},
    "opacus.accountants.analysis": {},
    "opacus.accountants.analysis.gdp": _same(
        "compute_mu_uniform compute_mu_poisson delta_eps_mu eps_from_mu compute_eps_uniform "
        "compute_eps_poisson", _GDP),
    "opacus.accountants.analysis.prv": _same(
        "DiscretePRV Domain PoissonSubsampledGaussianPRV TruncatedPrivacyRandomVariable "
        "compose_heterogeneous compute_safe_domain_size discretize", _PRV),
    "opacus.accountants.analysis.prv.compose": {"compose_heterogeneous": _PRV},
    "opacus.accountants.analysis.prv.domain": _same("Domain compute_safe_domain_size", _PRV),
    "opacus.accountants.analysis.prv.prvs": _same(
        "PoissonSubsampledGaussianPRV TruncatedPrivacyRandomVariable DiscretePRV discretize",
        _PRV),
    "opacus.accountants.analysis.rdp": {
        n: f"=dpfy.opacus._accountants:{n}" for n in ("compute_rdp", "get_privacy_spent")},
    "opacus.accountants.gdp": {
        "GaussianAccountant": "=dpfy.opacus._accountants:GaussianAccountant"},
    "opacus.accountants.prv": {"PRVAccountant": "=dpfy.opacus._accountants:PRVAccountant"},
    "opacus.accountants.rdp": {"RDPAccountant": "=dpfy.opacus._accountants:RDPAccountant"},
    "opacus.accountants.registry": {
        n: f"=dpfy.opacus._accountants:{n}" for n in ("register_accountant",
                                                       "create_accountant")},
    "opacus.accountants.utils": {
        "get_noise_multiplier": "=dpfy.opacus._accountants:get_noise_multiplier"},
    "opacus.data_loader": {
        "DPDataLoader": "=dpfy.opacus.data_loader:DPDataLoader",
        **_same("CollateFnWithEmpty wrap_collate_with_empty shape_safe dtype_safe "
                "switch_generator", _LOADER),
    },
    "opacus.distributed": {
        "DifferentiallyPrivateDistributedDataParallel":
            "=dpfy.opacus._compat:DifferentiallyPrivateDistributedDataParallel",
        "average_gradients": DISTRIBUTED,
    },
    "opacus.grad_sample": {
        **_same("AbstractGradSampleHooks AbstractGradSampleModule GradSampleHooks "
                "GradSampleHooksNoOp GradSampleModule GradSampleModuleExpandedWeights "
                "GradSampleModuleNoOp create_or_accumulate_grad_sample get_gsm_class "
                "prepare_module wrap_model", _GSM),
        **_same("GradSampleHooksFastGradientClipping GradSampleModuleFastGradientClipping",
                _GHOST),
        **_same("GradSampleHooksFastGradientClippingFSDP "
                "GradSampleModuleFastGradientClippingFSDP GradSampleHooksFastGradientClippingTP "
                "GradSampleModuleFastGradientClippingTP", _FSDP),
        **_same("register_grad_sampler register_norm_sampler", _RULE),
    },
    "opacus.grad_sample.conv": _same(
        "compute_conv_grad_sample convolution2d_backward_as_a_convolution", _RULE),
    "opacus.grad_sample.dp_multihead_attention": {"compute_sequence_bias_grad_sample": _RULE},
    "opacus.grad_sample.dp_rnn": {"compute_rnn_linear_grad_sample": _RULE},
    "opacus.grad_sample.embedding": _same(
        "compute_embedding_grad_sample compute_embeddingbag_gradsampler "
        "compute_embedding_norm_sample", _RULE),
    "opacus.grad_sample.embedding_norm_sample": {"compute_embedding_norm_sample": _RULE},
    "opacus.grad_sample.functorch": {
        "make_functional": "=dpfy.opacus._compat:make_functional",
        **_same("prepare_layer ft_compute_per_sample_gradient", _RULE),
    },
    "opacus.grad_sample.grad_sample_module": {
        **_same("create_or_accumulate_grad_sample promote_current_grad_sample GradSampleHooks "
                "GradSampleModule", _GSM)},
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping": _same(
        "create_norm_sample GradSampleHooksFastGradientClipping "
        "GradSampleModuleFastGradientClipping", _GHOST),
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp": _same(
        "GradSampleHooksFastGradientClippingFSDP GradSampleModuleFastGradientClippingFSDP",
        _FSDP),
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping_tp": _same(
        "GradSampleHooksFastGradientClippingTP GradSampleModuleFastGradientClippingTP", _FSDP),
    "opacus.grad_sample.group_norm": {"compute_group_norm_grad_sample": _RULE},
    "opacus.grad_sample.gsm_base": _same(
        "AbstractGradSampleHooks AbstractGradSampleModule", _GSM),
    "opacus.grad_sample.gsm_exp_weights": {"GradSampleModuleExpandedWeights": _GSM},
    "opacus.grad_sample.gsm_no_op": _same("GradSampleHooksNoOp GradSampleModuleNoOp", _GSM),
    "opacus.grad_sample.instance_norm": {"compute_instance_norm_grad_sample": _RULE},
    "opacus.grad_sample.layer_norm": {"compute_layer_norm_grad_sample": _RULE},
    "opacus.grad_sample.linear": _same(
        "compute_linear_grad_sample compute_linear_norm_sample", _RULE),
    "opacus.grad_sample.rms_norm": {"compute_rms_norm_grad_sample": _RULE},
    "opacus.grad_sample.utils": {
        **_same("register_grad_sampler register_norm_sampler", _RULE),
        **_same("prepare_module wrap_model get_gsm_class get_hooks_class", _GSM),
    },
    "opacus.lightning": _same(
        "DPLightningDataModule",
        "Lightning runs DP-SGD through dpfy.lightning.DPStrategy (the Trainer's strategy=), "
        "which keeps Poisson sampling itself"),
    "opacus.layers": {
        "DPGRU": "=torch.nn:GRU", "DPLSTM": _DPLSTM, "DPRNN": "=torch.nn:RNN",
        "DPMultiheadAttention": "=torch.nn:MultiheadAttention",
        **_same("RenameParamsMixin SequenceBias", _LAYER),
    },
    "opacus.layers.dp_multihead_attention": {
        "DPMultiheadAttention": "=torch.nn:MultiheadAttention", "SequenceBias": _LAYER},
    "opacus.layers.dp_rnn": {
        "DPRNN": "=torch.nn:RNN", "DPGRU": "=torch.nn:GRU", "DPLSTM": _DPLSTM,
        **_same("apply_permutation RNNLinear DPRNNCellBase DPRNNCell DPGRUCell DPLSTMCell "
                "DPRNNBase", _LAYER),
    },
    "opacus.layers.param_rename": _same("filter_out_old_keys RenameParamsMixin", _LAYER),
    "opacus.optimizers": {
        "DPOptimizer": "=dpfy.opacus.optimizer:DPOptimizer",
        "DPOptimizerFastGradientClipping": "=dpfy.opacus.optimizer:DPOptimizer",
        "DPPerLayerOptimizer": _PER_LAYER, "AdaClipDPOptimizer": _ADAPTIVE,
        **_same("DistributedDPOptimizer DistributedDPOptimizerFastGradientlipping "
                "SimpleDistributedPerLayerOptimizer", DISTRIBUTED),
        "FSDPOptimizerFastGradientClipping": _FSDP,
    },
    "opacus.optimizers.adaclipoptimizer": {"AdaClipDPOptimizer": _ADAPTIVE},
    "opacus.optimizers.ddp_perlayeroptimizer": _same(
        "SimpleDistributedPerLayerOptimizer DistributedPerLayerOptimizer", DISTRIBUTED),
    "opacus.optimizers.ddpoptimizer": {"DistributedDPOptimizer": DISTRIBUTED},
    "opacus.optimizers.ddpoptimizer_fast_gradient_clipping": {
        "DistributedDPOptimizerFastGradientClipping": DISTRIBUTED},
    "opacus.optimizers.fsdpoptimizer_fast_gradient_clipping": {
        "FSDPOptimizerFastGradientClipping": _FSDP},
    "opacus.optimizers.optimizer": {"DPOptimizer": "=dpfy.opacus.optimizer:DPOptimizer"},
    "opacus.optimizers.optimizer_fast_gradient_clipping": {
        "DPOptimizerFastGradientClipping": "=dpfy.opacus.optimizer:DPOptimizer"},
    "opacus.optimizers.perlayeroptimizer": {"DPPerLayerOptimizer": _PER_LAYER},
    "opacus.optimizers.utils": {"params": _TORCH},
    "opacus.privacy_engine": {"PrivacyEngine": "=dpfy.opacus.privacy_engine:PrivacyEngine"},
    "opacus.schedulers": _same(
        "ExponentialGradClip ExponentialNoise LambdaGradClip LambdaNoise StepGradClip "
        "StepNoise _GradClipScheduler _NoiseScheduler", _SCHEDULE),
    "opacus.schedulers.grad_clip_scheduler": _same(
        "ExponentialGradClip LambdaGradClip StepGradClip", _SCHEDULE),
    "opacus.schedulers.noise_scheduler": _same(
        "ExponentialNoise LambdaNoise StepNoise", _SCHEDULE),
    "opacus.utils": {},
    "opacus.utils.adaptive_clipping": _same(
        "DPLossFastGradientAdaptiveClipping DPTensorFastGradientAdaptiveClipping "
        "PrivacyEngineAdaptiveClipping", _ADAPTIVE),
    "opacus.utils.adaptive_clipping.adaptive_clipping_utils": _same(
        "DPTensorFastGradientAdaptiveClipping DPLossFastGradientAdaptiveClipping "
        "PrivacyEngineAdaptiveClipping", _ADAPTIVE),
    "opacus.utils.batch_memory_manager": {
        "BatchMemoryManager": "=dpfy.opacus.utils.batch_memory_manager:BatchMemoryManager",
        **_same("BatchSplittingSampler wrap_data_loader", _BMM),
    },
    "opacus.utils.fast_gradient_clipping_utils": _same(
        "DPTensorFastGradientClipping DPLossFastGradientClipping", _GHOST),
    "opacus.utils.fsdp_utils": _same("has_params iterate_submodules FSDP2Wrapper", _FSDP),
    "opacus.utils.module_utils": _same(
        "has_trainable_params parametrized_modules trainable_modules trainable_parameters "
        "requires_grad clone_module get_submodule are_state_dict_equal", _TORCH),
    "opacus.utils.packed_sequences": {"compute_seq_lengths": _TORCH},
    "opacus.utils.per_sample_gradients_utils": _same(
        "clone_module is_batch_empty ModelWithLoss compute_microbatch_grad_sample "
        "compute_opacus_grad_sample check_torch_version_for_ew_sample get_grad_sample_modes "
        "check_per_sample_gradients_are_correct compute_microbatch_grad_sample_tensor_or_seq "
        "compute_grad_samples_microbatch_and_opacus unpack_packedsequences", _TEST),
    "opacus.utils.tensor_utils": _same(
        "calc_sample_norms calc_sample_norms_one_layer sum_over_all_but_batch_and_last_n "
        "unfold2d unfold3d filter_dilated_rows", _TORCH),
    "opacus.utils.uniform_sampler": _same(
        "UniformWithReplacementSampler DistributedUniformWithReplacementSampler", _SAMPLER),
    "opacus.validators": {
        "ModuleValidator": "=dpfy.opacus.validators.module_validator:ModuleValidator",
        **_same("register_module_fixer register_module_validator", _VALIDATE),
    },
    "opacus.validators.batch_norm": _same("validate fix", _VALIDATE),
    "opacus.validators.errors": {
        **_same("UnsupportedError UnsupportedModuleError UnsupportableModuleError "
                "NotYetSupportedModuleError ShouldReplaceModuleError "
                "IllegalModuleConfigurationError", _ERR)},
    "opacus.validators.gru": _same("validate fix", _VALIDATE),
    "opacus.validators.instance_norm": _same("validate fix", _VALIDATE),
    "opacus.validators.lstm": _same("validate fix", _VALIDATE),
    "opacus.validators.module_validator": {
        "ModuleValidator": "=dpfy.opacus.validators.module_validator:ModuleValidator"},
    "opacus.validators.multihead_attention": _same("validate fix", _VALIDATE),
    "opacus.validators.utils": _same("register_module_validator register_module_fixer",
                                     _VALIDATE),
    "opacus.version": {"__version__": "=dpfy.opacus._surface:OPACUS_VERSION"},
}


def ours(module: str) -> str:
    """The ``dpfy.opacus`` module of an Opacus module name."""
    return "dpfy." + module


def resolve(target: str) -> Any:
    """The object of ``"=module:attribute"``."""
    module, _, attribute = target[1:].partition(":")
    return getattr(importlib.import_module(module), attribute)


def _getattr_for(module: str, names: dict[str, str], fallback: Any) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        status = names.get(name)
        if status is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {ours(module)!r} has no attribute {name!r}")
        if status.startswith("="):
            return resolve(status)
        raise ImportError(f"{module}.{name} is not part of dpfy.opacus: {status}",
                          name=ours(module))

    return __getattr__


def install() -> None:
    """Make every module of :data:`SURFACE` importable under ``dpfy.opacus`` (module
    docstring); called once by ``dpfy.opacus``."""
    for module in sorted(SURFACE, key=lambda m: m.count(".")):
        if module == "opacus":
            continue
        name = ours(module)
        parent_name, _, leaf = name.rpartition(".")
        parent = sys.modules[parent_name]
        try:
            target = importlib.import_module(name)  # a module dpfy has as a file
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            target = types.ModuleType(name, f"Opacus' ``{module}`` on dpfy: its names as "
                                      "dpfy.opacus._surface.SURFACE says (stub module).")
            target.__path__ = []  # submodules are in sys.modules already or made here
            sys.modules[name] = target
        setattr(parent, leaf, target)
        fallback = target.__dict__.get("__getattr__")
        target.__getattr__ = _getattr_for(module, SURFACE[module], fallback)  # type: ignore[method-assign]
