"""The native multi-LoRA op (torch.ops.pagedserve.lora_add_) against a float64 reference:
widths that are not multiples of its register strip, slots that skip the layer, groups
longer than four rows, rows in any order, and a row's bits the same in any batch."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import resolve_kernels

resolve_kernels("native")  # loads the op library; a broken build fails here rather than skipping


def reference(y, x, rows, slots, widths, a, b, magnitude=False) -> torch.Tensor:
    """y plus each row's (x A) B in float64; with `magnitude`, the same sums over absolute
    values (what bounds the fp32 rounding error), without y."""
    f = (lambda t: t.double().abs()) if magnitude else (lambda t: t.double())
    out = torch.zeros_like(y, dtype=torch.float64) if magnitude else y.double().clone()
    for r, s in zip(rows.tolist(), slots.tolist()):
        w = int(widths[s])
        out[r] += (f(x[r]) @ f(a[s, :, :w])) @ f(b[s, :w])
    return out


def case(t, inn, out, num_slots, rmax, seed, sort=True):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(t, inn, generator=g), torch.randn(t, out, generator=g)
    a, b = torch.randn(num_slots, inn, rmax, generator=g), torch.randn(num_slots, rmax, out, generator=g)
    rows = torch.randperm(t, generator=g)[: t - t // 4]
    slots = torch.randint(0, num_slots, (len(rows),), generator=g)
    if sort:
        order = torch.argsort(slots, stable=True)
        rows, slots = rows[order], slots[order]
    widths = torch.randint(0, rmax + 1, (num_slots,), generator=g)
    widths[0], widths[-1] = rmax, 0  # one slot at full width, one that skips the layer
    return y, x, rows, slots, widths, a, b


@pytest.mark.parametrize("shape", [(1, 576, 960, 2, 48), (10, 576, 960, 4, 48), (7, 64, 37, 3, 13),
                                   (300, 1536, 576, 4, 16), (33, 576, 3072, 2, 32), (9, 20, 17, 2, 3)])
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "any-order"])
def test_matches_a_float64_reference(shape, sort):
    y, x, rows, slots, widths, a, b = case(*shape, seed=sum(shape), sort=sort)
    expected = reference(y, x, rows, slots, widths, a, b)
    got = y.clone()
    assert torch.ops.pagedserve.lora_add_(got, x, rows, slots, widths, a, b) is got
    # fp32 sums of in + w products: each element within (in + w) unit roundoffs of its
    # sum of absolute terms (a dropped or doubled term would be ~1/in of it, far above).
    _, inn, _, _, rmax = shape
    bound = (inn + rmax + 1) * 2.0**-24 * (reference(y, x, rows, slots, widths, a, b, magnitude=True) + y.abs())
    assert torch.all((got.double() - expected).abs() <= bound)
    untouched = [i for i in range(shape[0]) if i not in set(rows.tolist())]
    skipped = [r for r, s in zip(rows.tolist(), slots.tolist()) if widths[s] == 0]
    assert torch.equal(got[untouched + skipped], y[untouched + skipped])


def test_a_rows_result_does_not_depend_on_its_batch():
    y, x, rows, slots, widths, a, b = case(40, 576, 960, 3, 48, seed=1)
    widths[:] = 48
    full = y.clone()
    torch.ops.pagedserve.lora_add_(full, x, rows, slots, widths, a, b)
    for i in (0, 5, len(rows) - 1):
        alone = y.clone()
        torch.ops.pagedserve.lora_add_(alone, x, rows[i : i + 1], slots[i : i + 1], widths, a, b)
        r = int(rows[i])
        assert torch.equal(alone[r], full[r])


@pytest.mark.parametrize("bad, message", [
    ("row", "row 99 out of range"), ("slot", "slot 7 out of range"), ("width", "width"),
    ("y", "y must be"), ("stack", "b_stack"),
])
def test_bad_arguments_are_errors_not_crashes(bad, message):
    y, x, rows, slots, widths, a, b = case(8, 16, 24, 2, 8, seed=2)
    if bad == "row":
        rows = rows.clone()
        rows[0] = 99
    elif bad == "slot":
        slots = slots.clone()
        slots[0] = 7
    elif bad == "width":
        widths = widths.clone()
        widths[0] = 9
    elif bad == "y":
        y = y.t()
    else:
        b = b[:, :4]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedserve.lora_add_(y, x, rows, slots, widths, a, b)
