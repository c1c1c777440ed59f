"""One layer's per-example gradients assembled from several parts (linear forms, dense grads).

A recurrent or attention layer computes several linear maps with parameters of its own
(``weight_ih_l0`` and ``weight_hh_l0`` per layer and direction; the query, key and value blocks
of ``in_proj_weight``). Each map is one :class:`~dpfy.training.norms.registry.LayerGrads` (a
:class:`~dpfy.training.norms.linear.LinearForm`, ghost or materialised by its own cost model);
:class:`CompositeGrads` reports them under the module's parameter names. A part may fill a
block of rows of a parameter (``in_proj_weight[0:E]`` for the query): the parameter's
per-example squared norm is then the sum of its blocks' norms, and its clipped sum is written
block by block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from dpfy.training.norms.registry import LayerGrads, OverwritingGrads, overwrites

#: Where a part's parameter lands: ``(module-local parameter name, rows)`` with ``rows`` a
#: slice of the parameter's first dimension, or ``None`` for the whole parameter.
Slot = tuple[str, slice | None]


class CompositeGrads:
    """LayerGrads of a module from ``parts``: ``[(part, {part name: slot})]``.

    Args:
      parts: each part and where its parameters land (see :data:`Slot`); a part's slots name
        exactly the parameters the part reports. A parameter may be filled by several parts
        only as disjoint row blocks (its per-example squared norm is then the sum of theirs);
        a whole parameter belongs to one part.
      shapes: the module-local parameter shapes (``{name: p.shape}``).

    Raises:
      KeyError: a slot names a parameter without a shape.
      ValueError: a whole parameter is filled by more than one part.
    """

    __slots__ = ("parts", "shapes")

    def __init__(
        self,
        parts: Sequence[tuple[LayerGrads, Mapping[str, Slot]]],
        shapes: Mapping[str, torch.Size | tuple[int, ...]],
    ) -> None:
        self.parts = list(parts)
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        slot_list = [slot for _, slots in self.parts for slot in slots.values()]
        for name, rows in slot_list:
            if name not in self.shapes:
                raise KeyError(f"no shape given for parameter {name!r}")
            if rows is None and sum(n == name for n, _ in slot_list) > 1:
                # the norm of a sum is not the sum of norms: one part per whole parameter
                raise ValueError(f"parameter {name!r} is filled whole by more than one part")

    def squared_norms(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part, slots in self.parts:
            sq = part.squared_norms()
            for pname, (name, _) in slots.items():  # row blocks: their norms add up
                out[name] = out[name] + sq[pname] if name in out else sq[pname]
        return out

    def zero_rows(self, rows: torch.Tensor) -> None:
        for part, _ in self.parts:
            part.zero_rows(rows)

    def per_example(self, name: str) -> torch.Tensor:
        """Per-example gradients of parameter ``name``: [N, *shape] (materialised)."""
        pieces: list[tuple[slice | None, torch.Tensor]] = []
        for part, slots in self.parts:
            for pname, (n, rows) in slots.items():
                if n == name:
                    pieces.append((rows, _dense(part, pname)))
        if not pieces:
            raise KeyError(name)
        batch = pieces[0][1].shape[0]
        full = pieces[0][1].new_zeros((batch, *self.shapes[name]))
        for rows, g in pieces:
            dst = full if rows is None else full[:, rows]
            dst += g.reshape(dst.shape)
        return full

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]:
        if out is None:
            ref = next(iter(weights.values()))
            filled = {name for _, slots in self.parts for name, _ in slots.values()}
            res = {
                name: torch.zeros(shape, dtype=ref.dtype, device=ref.device)
                for name, shape in self.shapes.items()
                if name in filled
            }
            overwrite = False
        else:
            res = out
        for part, slots in self.parts:  # each slot is written by exactly one part
            part_w = {pname: weights[name] for pname, (name, _) in slots.items()}
            dst = {
                pname: res[name] if rows is None else res[name][rows]
                for pname, (name, rows) in slots.items()
            }
            if overwrite and overwrites(type(part)):
                cast(OverwritingGrads, part).weighted_sum(part_w, dst, overwrite=True)
                continue
            if overwrite:  # first write of these blocks: clear the old contents
                for t in dst.values():
                    t.zero_()
            part.weighted_sum(part_w, dst)
        return res


def _dense(part: LayerGrads, name: str) -> torch.Tensor:
    fn = getattr(part, "per_example", None)
    if fn is None:
        raise NotImplementedError(
            f"{type(part).__name__} does not materialise per-example gradients, so it cannot "
            "share a parameter with another part"
        )
    out: torch.Tensor = fn(name)
    return out
