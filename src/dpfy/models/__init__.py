"""Pretrained models and the heads put on them: a leaf package every layer may import.

:mod:`dpfy.models.pretrained` loads the weights that ship inside packages (all-MiniLM-L6-v2,
offline), :mod:`dpfy.models.heads` holds the classification head on mean-pooled token states.
Neither imports anything of dpfy's, so the training recipes (:mod:`dpfy.training.text`), the
feature extractors (:mod:`dpfy.features.extract`) and the Hugging Face integration
(:mod:`dpfy.hf`) share them without depending on one another. ``transformers`` is imported only
inside the loaders (the ``nlp`` extra); importing this package does not import torch.
"""
