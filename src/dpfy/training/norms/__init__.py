"""Per-example gradient norms and clipped sums, one rule per layer family.

Importing this package registers the rules for ``nn.Linear`` (``linear.py``: outer-product
ghost norms without sequence dims; Gram-matrix ghost norms or materialised per-example
gradients with sequence dims, chosen per layer by cost), ``nn.Conv1d``/``nn.Conv2d``
(``conv.py``: per-example gradients from one grouped weight-gradient call, or ghost norms on
unfolded patches), ``nn.Embedding`` (``embedding.py``: row-sparse norms), ``nn.LayerNorm``,
``nn.GroupNorm`` and ``nn.RMSNorm`` (``normalization.py``), and -- by class name, without
importing ``transformers`` -- its GPT-2 ``Conv1D`` (``linear.py``, weight stored transposed)
and its per-model RMSNorm copies (``LlamaRMSNorm`` etc., ``normalization.py``).
``nn.RNN``/``nn.LSTM``/``nn.GRU`` and their cells (``recurrent.py``) keep their fused forward
and get a hand-written backward through time in batched ops (``recurrent_bptt.py``), the gate
weights' ghost norms sharing one Gram matrix (``recurrent_grads.py``); ``nn.MultiheadAttention``
(``attention.py``) is recomputed with its projections as targets, each a linear form. A Parameter
shared by several modules (tied input/output embeddings) is clipped exactly: the owners'
norms plus cross terms (:func:`~dpfy.training.norms.registry.register_cross_term`). Every
other module with trainable parameters is handled by
:func:`~dpfy.training.norms.fallback.fallback_rule` (``torch.func.vmap(grad)``, chunked).
Register a rule for your own layer with :func:`register_norm_rule`; check it against
:func:`dpfy.training.norms.reference.per_example_gradients`.
"""

from dpfy.training.norms import (  # noqa: F401 (register)
    attention,
    conv,
    embedding,
    embedding_bag,
    linear,
    normalization,
    recurrent,
)
from dpfy.training.norms.linear import LinearForm
from dpfy.training.norms.registry import (
    LayerGrads,
    MaterializedGrads,
    NormRule,
    Recomputed,
    fold_rows,
    register_norm_rule,
    tensor_sum,
)

__all__ = [
    "register_norm_rule",
    "NormRule",
    "LayerGrads",
    "LinearForm",
    "MaterializedGrads",
    "Recomputed",
    "fold_rows",
    "tensor_sum",
]
