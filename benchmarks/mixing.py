"""``python -m benchmarks.mixing``: what joining two paths in one call costs, by selection and by split.

One call of a layer whose rows follow two policies (half the rows each, interleaved by request as a batch
packs them): a Llama RMSNorm, a Llama MLP and causal attention over each request's own tokens (sdpa per
request). The "kernel" is the layer's own forward with its output shifted (a stand-in: the cost of a real
kernel is the same order as the original's). Each row of the table is one ``torch.utils.benchmark``
measurement (``blocked_autorange``), one CPU thread:

- ``one path``: the layer once on every row (what a step of one policy costs);
- ``select``: both paths on every row, then ``torch.where`` (``_mixing``'s select join: static shapes);
- ``split``: each path on its own rows (``index_select``, then ``index_copy_`` back: the split join).

Printed: torch's ``Compare`` table, then each join's ratio to ``one path``, for a decode step (16 rows, one
per request) and a prefill step (16 requests of 32 tokens). Read the ratios, not the times.
"""

from __future__ import annotations

import itertools
import statistics
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.benchmark import Compare, Measurement, Timer

from kernelpolicy._forward._mixing import _joined, _select, _taken

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["main"]

HIDDEN, INTERMEDIATE, HEADS = 512, 1376, 8


def _layers() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """Each layer's forward on hidden states (1, rows, hidden), and the row axis of its output."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS)
    norm, mlp = LlamaRMSNorm(HIDDEN).eval(), LlamaMLP(config).eval()  # type: ignore[no-untyped-call]
    return {"norm": (norm, -2), "MLP": (mlp, -2)}


def _attention(lengths: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Causal attention of each request over its own rows (q = k = v = the hidden states, split in heads)."""
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

    def attend(hidden: torch.Tensor) -> torch.Tensor:
        heads = hidden.view(1, -1, HEADS, HIDDEN // HEADS).transpose(1, 2)  # (1, heads, rows, dim)
        parts = [
            torch.nn.functional.scaled_dot_product_attention(
                heads[:, :, a:b], heads[:, :, a:b], heads[:, :, a:b], is_causal=True
            )
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat(parts, dim=2).transpose(1, 2).reshape(1, -1, HIDDEN)

    return attend


def _arms(
    layer: Callable[[torch.Tensor], torch.Tensor], dim: int, hidden: torch.Tensor, mask: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    rows = hidden.shape[dim]
    kernel_rows, original_rows = mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)
    groups = (kernel_rows, original_rows)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return layer(x) + 0.5

    def split() -> Any:
        parts = []
        for index, path in zip(groups, (kernel, layer), strict=True):
            (taken,), _ = _taken((hidden,), {}, index, dim, rows)
            parts.append((index, path(taken)))
        return _joined(parts, dim, rows)

    return {
        "one path": lambda: layer(hidden),
        "select": lambda: _select(mask, kernel(hidden), layer(hidden), dim),
        "split": split,
    }


def main(min_run_time: float = 0.5) -> list[Measurement]:
    torch.set_num_threads(1)
    results: list[Measurement] = []
    ratios: dict[tuple[str, str, str], float] = {}
    steps = {"decode": [1] * 16, "prefill": [32] * 16}
    with torch.no_grad():
        for step, lengths in steps.items():
            rows = sum(lengths)
            hidden = torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(0))
            owner = torch.tensor([i % 2 == 0 for i, n in enumerate(lengths) for _ in range(n)])  # by request
            layers = {**_layers(), "attention": (_attention(lengths), -2)}
            for name, (layer, dim) in layers.items():
                times: dict[str, float] = {}
                for arm, run in _arms(layer, dim, hidden, owner).items():
                    timer = Timer(
                        stmt="run()",
                        globals={"run": run},
                        label="one call of a layer, rows of two policies",
                        sub_label=f"{name}, {step} ({rows} rows)",
                        description=arm,
                        num_threads=1,
                    )
                    measurement = timer.blocked_autorange(min_run_time=min_run_time)
                    results.append(measurement)
                    times[arm] = statistics.median(measurement.times)
                for arm in ("select", "split"):
                    ratios[(name, step, arm)] = times[arm] / times["one path"]
    print(Compare(results))
    print(f"{'layer':<10} {'step':<8} {'select':>8} {'split':>8}   (time of one call / one path's)")
    for name in ("norm", "MLP", "attention"):
        for step in steps:
            print(f"{name:<10} {step:<8} {ratios[(name, step, 'select')]:>8.2f} {ratios[(name, step, 'split')]:>8.2f}")
    return results


if __name__ == "__main__":
    main()
