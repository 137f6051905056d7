"""Every memory layout torch allows for a tensor of a given logical shape, built over a leaf
`base` so gradients and "was the caller's memory written?" can be checked on the base."""
import torch

LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "expanded", "overlapping")


def build(layout, shape, make, step=1):
    """(base leaf, view function): view(base) has `shape` and the named layout; `make(n)` fills
    a base of n elements (a flat tensor). step: the row stride of 'overlapping', in [1, cols)."""
    shape = tuple(shape)
    *lead, cols = shape
    rows = 1
    for d in lead:
        rows *= d
    if rows == 0 or layout == "contiguous":
        return make(rows * cols).view(shape), lambda b: b
    if layout == "transposed":  # non-unit last-dim stride (2-D) or unflattenable leading dims (3-D)
        if len(shape) == 2:
            return make(rows * cols).view(cols, rows), lambda b: b.t()
        s, bb, c = shape
        return make(rows * cols).view(bb, s, c), lambda b: b.transpose(0, 1)
    if layout == "sliced":  # step slice over rows, a column window with an offset
        big = (*lead[:-1], 2 * lead[-1], cols + 3)
        n = 1
        for d in big:
            n *= d
        return make(n).view(big), lambda b: b[..., ::2, 1:cols + 1]
    if layout == "offset":  # storage offset of one element: no row is 16-byte aligned
        return make(rows * cols + 1), lambda b: b[1:].view(shape)
    if layout == "expanded":  # stride-0 rows
        return make(cols).view(*([1] * len(lead)), cols), lambda b: b.expand(shape)
    if layout == "overlapping":  # rows `step` elements apart, step < cols: rows share memory
        step = max(1, min(step, cols - 1)) if cols > 1 else 1
        n = (rows - 1) * step + cols
        strides = [step * (rows // lead[0])] if len(lead) == 2 else []
        strides = tuple(strides + [step, 1])
        return make(n), lambda b: b.as_strided(shape, strides)
    raise ValueError(layout)


def leaf(layout, shape, dtype, device, gen, scale=1.0, step=1, requires_grad=True):
    base, view = build(layout, shape,
                       lambda n: (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype),
                       step)
    return base.to(device).requires_grad_(requires_grad), view
