"""Opacus' DP layers are PyTorch's own layers in dpfy.

Opacus re-implements recurrent and attention layers (``DPLSTM``, ``DPGRU``, ``DPRNN``,
``DPMultiheadAttention``) so that its hooks can see per-example gradients. dpfy clips
``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (packed sequences included) and ``nn.MultiheadAttention``
exactly as they are (``tests/training/test_layer_zoo.py``), so a script that imports the DP
layers from here gets the PyTorch classes: the same constructor arguments and outputs, and a
``state_dict`` with PyTorch's keys (Opacus' ``DPLSTM`` names them differently).
"""

from torch import nn

DPLSTM = nn.LSTM
DPGRU = nn.GRU
DPRNN = nn.RNN
DPMultiheadAttention = nn.MultiheadAttention

__all__ = ["DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN"]
