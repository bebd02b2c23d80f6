"""DFlash 2's grouped dynamic causal conv over the block axis (SPEC 3.1).

One operation, three implementations: `dynamic_conv_reference` (pure MLX, the spec in
code), `dynamic_conv_metal` (one custom Metal kernel for the whole conv), and the
dispatcher `dynamic_conv`, which takes the kernel on an Apple GPU and the reference
elsewhere. `DynamicConv` is the checkpoint module (`attention_conv` / `mlp_conv`) with its
cross-block state rows (`ConvRows`, held per request). Knows nothing about attention,
drafts or decoding.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def dynamic_conv_reference(
    x: mx.array, base: mx.array, delta: mx.array, state: mx.array | None = None
) -> mx.array:
    """`out_t = sum_{j<taps} (base[j] + delta_t[j]) * x_{t-j}` per channel.

    x: (B, L, D) rows of one block; base: (taps, D) per-channel coefficients;
    delta: (B, L, taps, D // g) per-group dynamic coefficients, broadcast over each group of
    g channels; state: (B, D), the row before the block (`x_{-1}`), or None for zero.
    Rows before that are zero. Returns (B, L, D) in x's dtype.
    """
    B, L, D = x.shape
    taps = base.shape[0]
    g = D // delta.shape[-1]
    k = base + mx.repeat(delta, g, axis=-1)  # (B, L, taps, D)
    pad = [mx.zeros((B, taps - 1, D), dtype=x.dtype)]
    if state is not None and taps > 1:
        pad = [mx.zeros((B, taps - 2, D), dtype=x.dtype), state[:, None].astype(x.dtype)]
    xp = mx.concatenate([*pad, x], axis=1)  # row i holds x_{i - taps + 1}
    out = k[:, :, 0] * x
    for j in range(1, taps):
        out = out + k[:, :, j] * xp[:, taps - 1 - j : taps - 1 - j + L]
    return out.astype(x.dtype)


# The body of the Metal kernel: one thread per output element (channel c, row t, batch b).
# It is also compiled as C++ by the tests (a loop over the grid stands in for the GPU), so
# it sticks to what both languages accept.
CONV_KERNEL_SOURCE = """
    uint c = thread_position_in_grid.x;
    uint t = thread_position_in_grid.y;
    uint b = thread_position_in_grid.z;
    if (c >= D || t >= L) {
        return;
    }
    float acc = 0.0f;
    for (int j = 0; j < TAPS; ++j) {
        int s = int(t) - j;
        float xv = 0.0f;
        if (s >= 0) {
            xv = float(x[(b * L + s) * D + c]);
        } else if (s == -1 && HAS_STATE) {
            xv = float(state[b * D + c]);
        }
        float k = float(base[j * D + c]) + float(delta[((b * L + t) * TAPS + j) * (D / G) + c / G]);
        acc += k * xv;
    }
    out[(b * L + t) * D + c] = static_cast<T>(acc);
"""

_KERNEL = None


def dynamic_conv_metal(
    x: mx.array, base: mx.array, delta: mx.array, state: mx.array | None = None
) -> mx.array:
    """The same operation as `dynamic_conv_reference`, as one Metal kernel launch."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="dflash_dynamic_conv",
            input_names=["x", "base", "delta", "state"],
            output_names=["out"],
            source=CONV_KERNEL_SOURCE,
        )
    B, L, D = x.shape
    taps = base.shape[0]
    groups = delta.shape[-1]
    has_state = state is not None
    if state is None:
        state = mx.zeros((B, D), dtype=x.dtype)
    (out,) = _KERNEL(
        inputs=[x, base.astype(x.dtype), delta.astype(x.dtype), state.astype(x.dtype)],
        template=[
            ("T", x.dtype),
            ("TAPS", taps),
            ("G", D // groups),
            ("L", L),
            ("D", D),
            ("HAS_STATE", has_state),
        ],
        grid=(D, L, B),
        threadgroup=(min(D, 256), 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return out


def use_metal_kernel() -> bool:
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def dynamic_conv(
    x: mx.array, base: mx.array, delta: mx.array, state: mx.array | None = None
) -> mx.array:
    """Dispatch: the Metal kernel on an Apple GPU, the pure-MLX reference elsewhere."""
    if use_metal_kernel():
        return dynamic_conv_metal(x, base, delta, state)
    return dynamic_conv_reference(x, base, delta, state)


class ConvRows:
    """One request's cross-block rows of one `DynamicConv` (part of a `DraftState`)."""

    def __init__(self) -> None:
        self.state: list[mx.array | None] = [None, None]  # x_{-1} for prepare / finish
        self.last: list[mx.array | None] = [None, None]  # inputs of the latest block

    def commit(self, index: int | None) -> None:
        """Keep the inputs at block index `index` (the last accepted row) as the next
        block's `x_{-1}`; `None` forgets them (new prompt, or a cycle without a draft)."""
        if index is None or self.last[0] is None:
            self.state = [None, None]
        else:
            self.state = [self.last[0][:, index], self.last[1][:, index]]
        self.last = [None, None]


class DynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv`: a conv before and after one sublayer (SPEC 3.1).

    Both convs share one projection of the sublayer input `u`:
    `delta = kernel_projection(u)` as (B, L, 2, taps, D // g); `prepare(u)` uses
    `base_kernel[0]` and `delta[:, :, 0]`, `finish(y)` uses `base_kernel[1]`, `delta[:, :, 1]`.
    """

    def __init__(self, dim: int, taps: int, group: int):
        super().__init__()
        if dim % group:
            raise ValueError(f"conv_group_size {group} does not divide hidden_size {dim}")
        self.taps, self.group = taps, group
        # Identity taps (x_t passes through) until a checkpoint says otherwise.
        self.base_kernel = mx.zeros((2, taps, dim)).at[:, 0].add(1.0)
        self.kernel_projection = nn.Linear(dim, 2 * taps * dim // group, bias=False)
        self.carry_state = False

    def deltas(self, u: mx.array) -> mx.array:
        B, L, D = u.shape
        return self.kernel_projection(u).reshape(B, L, 2, self.taps, D // self.group)

    def _conv(self, which: int, x: mx.array, delta: mx.array, rows: ConvRows | None) -> mx.array:
        state = None
        if rows is not None:
            rows.last[which] = x
            state = rows.state[which] if self.carry_state else None
        return dynamic_conv(x, self.base_kernel[which], delta[:, :, which], state)

    def prepare(self, u: mx.array, delta: mx.array, rows: ConvRows | None = None) -> mx.array:
        """`rows`: the request's cross-block rows (None in training: zero before index 0)."""
        return self._conv(0, u, delta, rows)

    def finish(self, y: mx.array, delta: mx.array, rows: ConvRows | None = None) -> mx.array:
        return self._conv(1, y, delta, rows)
