"""``python -m benchmarks.mixing``: what joining two paths in one call costs, by selection and by split.

One call of a layer whose rows follow two policies (half the rows each, interleaved by request as a batch
packs them): a Llama RMSNorm, a Llama MLP and causal attention over each request's own tokens (sdpa per
request). The "kernel" is the layer's own forward with its output shifted (a stand-in: the cost of a real
kernel is the same order as the original's). Each row of the table is one ``torch.utils.benchmark``
measurement (``blocked_autorange``), one CPU thread:

- ``one path``: the layer once on every row (what a step of one policy costs);
- ``select``: both paths on every row, each on a clone of the input, then joined row by row (``_row_join``'s
  select: static shapes);
- ``split``: each path on its own rows (cut out, then put back: the split join).

Both joins are kernelpolicy's own (``_row_join.GroupInputs`` and ``joined``: the rows found from the call's shapes,
what a path writes in place kept to its rows). Printed: torch's ``Compare`` table, then each join's ratio to
``one path``, for a decode step (16 rows, one per request) and a prefill step (16 requests of 31 tokens: 496 rows,
so that no axis of the hidden size 512 looks like the rows). Read the ratios, not the times.
"""

from __future__ import annotations

import itertools
import statistics
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.benchmark import Compare, Measurement, Timer

from kernelpolicy._forward._row_join import GroupInputs, joined

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["main"]

HIDDEN, INTERMEDIATE, HEADS = 512, 1376, 8


def _layers() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each layer's forward on hidden states (1, rows, hidden)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS)
    norm, mlp = LlamaRMSNorm(HIDDEN).eval(), LlamaMLP(config).eval()  # type: ignore[no-untyped-call]
    return {"norm": norm, "MLP": mlp}


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
    layer: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, mask: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    rows = hidden.shape[-2]
    kernel_rows, original_rows = mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)
    groups = (kernel_rows, original_rows)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return layer(x) + 0.5

    def join(every_row: bool) -> Any:
        inputs = GroupInputs("bench", rows, (hidden,), {})
        outputs = []
        for index, path in zip(groups, (kernel, layer), strict=True):
            (taken,), _ = inputs.own(index, every_row)
            outputs.append((index, path(taken)))
        if every_row:
            out = joined("bench", rows, [(mask, outputs[0][1]), (None, outputs[1][1])], [])
        else:
            out = joined("bench", rows, [], outputs)
        inputs.write_back()
        return out

    return {"one path": lambda: layer(hidden), "select": lambda: join(True), "split": lambda: join(False)}


def main(min_run_time: float = 0.5) -> list[Measurement]:
    torch.set_num_threads(1)
    results: list[Measurement] = []
    ratios: dict[tuple[str, str, str], float] = {}
    steps = {"decode": [1] * 16, "prefill": [31] * 16}
    with torch.no_grad():
        for step, lengths in steps.items():
            rows = sum(lengths)
            hidden = torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(0))
            owner = torch.tensor([i % 2 == 0 for i, n in enumerate(lengths) for _ in range(n)])  # by request
            layers = {**_layers(), "attention": _attention(lengths)}
            for name, layer in layers.items():
                times: dict[str, float] = {}
                for arm, run in _arms(layer, hidden, owner).items():
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
