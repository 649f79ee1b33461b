"""The rows of a mixed call, found from the call: which axis of each tensor holds the step's rows, each group's own
copies of the arguments, and the groups' outputs joined per row.

This module owns :func:`row_axis` (the one axis of a tensor whose size is the step's row count), :class:`GroupInputs`
(a group's inputs: clones, or its own rows; what a path wrote in place goes back into a caller's tensor on that
group's rows only), :func:`joined` (outputs joined per row through tensors, tuples, NamedTuples, lists, dicts,
``ModelOutput`` and dataclasses) and :class:`UnsplittableCall`, raised where a call's shapes do not show its rows
(several axes of the row count, or an output without rows that differs by path), before any caller's tensor is
written. No declaration per layer class is read here: one class is called on many shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._values._tensors import map_tensors, tensors_in

__all__ = ["GroupInputs", "UnsplittableCall", "joined", "row_axis", "shows_rows"]


class UnsplittableCall(Exception):  # noqa: N818  # a signal to the batching seam, not an error of the user's
    """A mixed call whose shapes do not show the step's rows: no row of it is joined, the step runs again.

    Raised before any caller's tensor is written. ``size`` is the step's row count where a tensor has several axes
    of that size (a step of another row count, or one policy at a time, is right); None where a value shows no
    row at all (an output without an axis of the step's rows that differs between the paths).
    """

    def __init__(self, layer_name: str, reason: str, size: int | None, *, again: bool = False) -> None:
        super().__init__(f"kernel layer {layer_name!r}: the rows of a mixed call cannot be told apart: {reason}")
        self.layer_name = layer_name
        self.size = size
        #: Nothing to remember of the call's shapes: this step runs one policy at a time, and later ones mix again.
        self.again = again


def row_axis(tensor: torch.Tensor, count: int, layer_name: str) -> int | None:
    """The one axis of ``tensor`` of size ``count`` (the step's rows), None if it has none.

    Several such axes (a step of 4 rows through a per-head norm of 4 heads): :class:`UnsplittableCall`.
    """
    found = None
    for axis, size in enumerate(tensor.shape):
        if size == count:
            if found is not None:
                raise UnsplittableCall(layer_name, f"{count} rows and a tensor of shape {tuple(tensor.shape)}", count)
            found = axis
    return found


def shows_rows(value: Any, count: int) -> bool:
    """Whether no tensor in ``value`` has several axes of the step's ``count`` rows (checked while tracing)."""
    return all(sum(size == count for size in tensor.shape) <= 1 for tensor in tensors_in(value))


class GroupInputs:
    """The arguments of one mixed call as each group gets them (clones, or its own rows), and what each path wrote."""

    __slots__ = ("_shown", "args", "count", "kwargs", "name", "written")

    def __init__(self, name: str, count: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.name, self.count, self.args, self.kwargs = name, count, args, kwargs
        self._shown: list[torch.Tensor] | None = None  # the tensors that hold the step's rows, found once
        #: Per copy of a caller's tensor: (the tensor, the copy, the copy's version when made, the group's rows,
        #: whether the copy holds every row).
        self.written: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, bool]] = []

    def own(self, rows: torch.Tensor, every_row: bool, clone: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A group's arguments: each tensor with the step's rows cloned (``every_row``) or cut to ``rows``.

        ``clone`` False (every row, a path seen not to write its inputs): the caller's tensors themselves, whose
        versions :meth:`wrote_shared` checks after the group ran.
        """
        if every_row and not clone:  # the structure as it is: only the versions of its tensors with rows are kept
            if self._shown is None:
                self._shown = [t for t in tensors_in((self.args, self.kwargs)) if self.count in t.shape]
            self.written += [(tensor, tensor, tensor._version, rows, True) for tensor in self._shown]
            return self.args, self.kwargs

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if self.count not in tensor.shape:
                return tensor  # no row of the step (a table, positions of another length): the same for each group
            if every_row:
                made = tensor.clone() if clone else tensor
            else:
                axis = row_axis(tensor, self.count, self.name)
                made = tensor if axis is None else tensor.index_select(axis, rows)
            self.written.append((tensor, made, made._version, rows, every_row))
            return made

        return map_tensors(self.args, copy), map_tensors(self.kwargs, copy)

    def wrote(self, mark: int) -> bool:
        """Whether the group whose inputs were made since ``mark`` wrote one of them in place.

        :class:`UnsplittableCall` if it wrote one of the caller's own tensors it was given (see :meth:`wrote_shared`).
        """
        wrote = False
        for tensor, made, version, _, _ in self.written[mark:]:
            if made._version != version:
                if made is tensor:
                    raise UnsplittableCall(self.name, "a path wrote in place the inputs it shared", None, again=True)
                wrote = True
        return wrote

    def wrote_shared(self, mark: int) -> None:
        """:class:`UnsplittableCall` if the group given the caller's own tensors since ``mark`` wrote one of them:
        the groups after it would read what it wrote, and the rows of the others hold it (the step runs again)."""
        for tensor, made, version, _, _ in self.written[mark:]:
            if made is tensor and tensor._version != version:
                raise UnsplittableCall(self.name, "a path wrote in place the inputs it shared", None, again=True)

    def discard(self, mark: int) -> None:
        """Forget the copies made since ``mark`` (a group's attempt that raised: it runs again on its own rows)."""
        del self.written[mark:]

    def write_back(self) -> None:
        """What a path wrote in place into a copy of a caller's tensor, back into it on the group's rows only."""
        for tensor, made, version, rows, every_row in self.written:
            if made is tensor or made._version == version:
                continue
            axis = row_axis(tensor, self.count, self.name)
            if axis is None:
                continue
            with torch.no_grad():
                tensor.index_copy_(axis, rows, made.index_select(axis, rows) if every_row else made)
        self.written.clear()


def joined(
    name: str, count: int, whole: list[tuple[torch.Tensor | None, Any]], parts: list[tuple[torch.Tensor, Any]]
) -> Any:
    """The outputs of the groups joined per row, through tensors, tuples (named too), lists, dicts and dataclasses.

    ``whole``: the outputs of groups that ran on every row, each with its rows' mask, the last one (mask None)
    the base; ``parts``: the outputs of groups that ran on their own rows, with those rows.
    """
    values = [output for _, output in whole] + [output for _, output in parts]
    first = values[0]

    def fields(key: Any) -> tuple[list[tuple[torch.Tensor | None, Any]], list[tuple[torch.Tensor, Any]]]:
        return [(mask, key(output)) for mask, output in whole], [(index, key(output)) for index, output in parts]

    def each(items: list[Any]) -> list[Any]:
        return [joined(name, count, *fields(lambda output, i=i: output[i])) for i in range(len(items))]

    if isinstance(first, torch.Tensor):
        if not all(isinstance(value, torch.Tensor) for value in values):
            raise UnsplittableCall(name, "a path returned a tensor where another did not", None)
        return _joined_tensor(name, count, whole, parts)
    if isinstance(first, (tuple, list)):
        if any(type(value) is not type(first) or len(value) != len(first) for value in values):
            raise UnsplittableCall(name, "the paths returned sequences of different types or lengths", None)
        items = each(list(first))
        if isinstance(first, tuple):
            return type(first)(*items) if hasattr(first, "_fields") else tuple(items)
        return items
    if isinstance(first, dict):
        keys = list(first)
        if any(type(value) is not type(first) or list(value) != keys for value in values):
            raise UnsplittableCall(name, "the paths returned mappings of different types or keys", None)
        mapping = {key: joined(name, count, *fields(lambda output, key=key: output[key])) for key in keys}
        if type(first) is dict:
            return mapping
        if all(isinstance(key, str) for key in keys):
            return type(first)(**mapping)
        return type(first)(mapping)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if any(type(value) is not type(first) for value in values):
            raise UnsplittableCall(name, "the paths returned different types", None)
        changes = {
            field.name: joined(name, count, *fields(lambda output, n=field.name: getattr(output, n)))
            for field in dataclasses.fields(first)
            if field.init
        }
        return dataclasses.replace(first, **changes)
    if all(value is first or _equal(value, first) for value in values[1:]):
        return first
    raise UnsplittableCall(name, f"the paths returned different values of {type(first).__name__}, not rows", None)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  # a value without a plain equality is not the same value
        return False


def _joined_tensor(
    name: str, count: int, whole: list[tuple[torch.Tensor | None, Any]], parts: list[tuple[torch.Tensor, Any]]
) -> torch.Tensor:
    """One tensor of the outputs joined on its axis of the step's rows (see :func:`_joined`)."""
    if whole:
        base: torch.Tensor = whole[-1][1]
        axis = row_axis(base, count, name)
        if axis is None or any(output.shape != base.shape for _, output in whole):
            return _same(name, [output for _, output in whole] + [output for _, output in parts])
        shape = [1] * base.dim()
        shape[axis] = count
        out = base
        for mask, output in whole[-2::-1]:
            assert mask is not None
            out = torch.where(mask.view(shape), output, out)
        for index, output in parts:
            if output.dim() != base.dim() or output.shape[axis] != index.shape[0]:
                raise UnsplittableCall(name, f"a group's output of shape {tuple(output.shape)}", None)
            out = out.index_copy(axis, index, output)  # a new tensor: ``out`` may be a module's own
        return out
    outputs: list[torch.Tensor] = [output for _, output in parts]
    first = outputs[0]
    shapes = [tuple(output.shape) for output in outputs]
    lengths = [index.shape[0] for index, _ in parts]
    fits = [] if sum(lengths) != count else [axis for axis in range(first.dim()) if _fits(shapes, lengths, axis)]
    if len(fits) != 1:
        if not fits:
            return _same(name, outputs)
        raise UnsplittableCall(name, f"{count} rows and outputs of shapes {[tuple(o.shape) for o in outputs]}", count)
    axis = fits[0]
    shape = list(first.shape)
    shape[axis] = count
    out = first.new_empty(shape)
    for index, output in parts:
        out.index_copy_(axis, index, output)
    return out


def _fits(shapes: list[tuple[int, ...]], lengths: list[int], axis: int) -> bool:
    """Whether outputs of ``shapes`` hold their groups' ``lengths`` rows on ``axis``, and agree on every other axis."""
    first = shapes[0]
    before, after = first[:axis], first[axis + 1 :]
    for shape, length in zip(shapes, lengths, strict=True):
        if len(shape) != len(first) or shape[axis] != length or shape[:axis] != before or shape[axis + 1 :] != after:
            return False
    return True


def _same(name: str, outputs: list[torch.Tensor]) -> torch.Tensor:
    """An output without the step's rows: one value for the whole call, which every path must agree on."""
    first = outputs[0]
    if all(o.shape == first.shape and torch.equal(o, first) for o in outputs[1:]):
        return first
    raise UnsplittableCall(
        name, f"an output of shape {tuple(first.shape)} without the step's rows differs by path", None
    )
