"""The low-bit payload kernels (mpilossy_quant.h) on their own: layout,
error bound, exact constants, non-finite groups, and unbiased stochastic
rounding over seeds.  No MPI: a single process."""

import numpy as np
import pytest

from mpilossy import _core


def encode(x, bits, group, seed=1, scale=1.0):
    out = np.empty(_core.quant_bytes(x.size, group, bits), np.uint8)
    _core.quant_kernel("quantize", out, x, bits, group, seed, scale)
    return out


def decode(coded, n, bits, group):
    out = np.empty(n, np.float32)
    _core.quant_kernel("dequantize", out, coded, bits, group)
    return out


def reference_decode(coded, n, bits, group):
    """The documented layout, read with numpy: scales, then the codes."""
    groups = -(-n // group)
    scales = coded[:4 * groups].view(np.float32)
    if bits == 8:
        codes = coded[4 * groups:4 * groups + n].view(np.int8).astype(np.float32)
    else:
        packed = coded[4 * groups:]
        codes = np.empty(2 * packed.size, np.int16)
        codes[0::2] = (packed & 15).astype(np.int16) - 8
        codes[1::2] = (packed >> 4).astype(np.int16) - 8
        codes = codes[:n].astype(np.float32)
    return codes * np.repeat(scales, group)[:n]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,group", [(1, 2), (7, 4), (1000, 64), (1001, 64), (4096, 128)])
def test_layout_and_error_bound(bits, n, group):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3
    coded = encode(x, bits, group)
    assert coded.size == 4 * -(-n // group) + (n if bits == 8 else -(-n // 2))
    y = decode(coded, n, bits, group)
    np.testing.assert_array_equal(y, reference_decode(coded, n, bits, group))
    maxcode = 127 if bits == 8 else 7
    for lo in range(0, n, group):
        step = np.abs(x[lo:lo + group]).max() / maxcode
        assert np.all(np.abs(y[lo:lo + group] - x[lo:lo + group]) <= step * (1 + 1e-5))


@pytest.mark.parametrize("bits", [8, 4])
def test_constants_zeros_and_scale(bits):
    x = np.concatenate([np.full(64, -2.5), np.zeros(64), np.full(64, 1e-30)]).astype(np.float32)
    y = decode(encode(x, bits, 64), x.size, bits, 64)
    np.testing.assert_allclose(y, x, rtol=1e-6)
    y2 = decode(encode(x, bits, 64, scale=0.5), x.size, bits, 64)
    np.testing.assert_allclose(y2, x * 0.5, rtol=1e-6)
    acc = np.ones(x.size, np.float32)
    _core.quant_kernel("dequantize_add", acc, encode(x, bits, 64), bits, 64)
    np.testing.assert_allclose(acc, 1 + x, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value_poisons_only_its_group(bad):
    x = np.ones(128, np.float32)
    x[70] = bad
    y = decode(encode(x, 8, 64), 128, 8, 64)
    assert np.all(np.isnan(y[64:])) and np.all(y[:64] == 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_over_seeds(bits):
    n, group, seeds = 256, 32, 2000
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    samples = np.stack([decode(encode(x, bits, group, seed), n, bits, group)
                        for seed in range(1, seeds + 1)]).astype(np.float64)
    sd = samples.std(axis=0, ddof=1)
    varying = sd > 0
    assert varying.mean() > 0.9          # all but the groups' largest values are rounded
    t = (samples.mean(axis=0) - x)[varying] / (sd[varying] / np.sqrt(seeds))
    assert np.abs(t).max() < 5.5, np.abs(t).max()


def test_bad_arguments():
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError):
        _core.quant_kernel("quantize", np.empty(100, np.uint8), x, 3, 64)
    with pytest.raises(ValueError):
        _core.quant_kernel("quantize", np.empty(100, np.uint8), x, 8, 63)
    with pytest.raises(ValueError, match="needs"):
        _core.quant_kernel("quantize", np.empty(5, np.uint8), x, 8, 64)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [2, 8, 64, 128])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1000, 100_003])
def test_vector_encoder_gives_the_reference_bytes(bits, group, n):
    """The AVX2 encoder (where the CPU has it) writes exactly what the
    one-value-at-a-time encoder writes, edge values included: NaN and Inf
    groups, constant and zero groups, values near float32's largest."""
    rng = np.random.default_rng([bits, group, n])
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
    for at, value in ((3, np.nan), (n // 2, np.inf), (n - 1, -3e38)):
        if at < n and n > 16:
            x[at] = value
    if n >= 200:
        x[128:192] = 2.5
        x[64:128] = 0.0
    for seed, scale in ((1, 1.0), (77, 0.3)):
        vector = encode(x, bits, group, seed, scale)
        portable = np.empty_like(vector)
        _core.quant_kernel("quantize_portable", portable, x, bits, group, seed, scale)
        np.testing.assert_array_equal(vector, portable)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [2, 8, 64])
@pytest.mark.parametrize("n", [1, 9, 64, 1001])
def test_decoders_add_exactly_what_the_layout_says(bits, group, n):
    """dequantize_add (vectorised for int4 where the CPU has AVX2): acc +
    code * scale, as the documented layout read with numpy gives."""
    rng = np.random.default_rng([bits, group, n, 1])
    x = rng.standard_normal(n).astype(np.float32)
    coded = encode(x, bits, group, seed=5)
    acc = rng.standard_normal(n).astype(np.float32)
    out = acc.copy()
    _core.quant_kernel("dequantize_add", out, coded, bits, group)
    np.testing.assert_array_equal(out, acc + reference_decode(coded, n, bits, group))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kernel", ["quantize", "quantize_portable"])
@pytest.mark.parametrize("tiny", [1e-37, 3e-38, 1e-40, 1.4e-45])
def test_a_group_of_tiny_values_decodes_to_them(bits, kernel, tiny):
    """A group whose largest magnitude is below maxcode / FLT_MAX: its
    inverse scale overflowed to inf, 0 * inf gave NaN and the cast of NaN to
    an int is undefined (issue 27, item 9: one 1e-37 among zeros decoded as
    1e-37 everywhere).  Zeros must stay zeros, the tiny value within a step."""
    x = np.zeros(64, np.float32)
    x[5] = tiny
    x[40] = -tiny / 2
    for seed in range(1, 9):
        out = np.empty(_core.quant_bytes(x.size, 64, bits), np.uint8)
        _core.quant_kernel(kernel, out, x, bits, 64, seed)
        y = decode(out, x.size, bits, 64)
        assert np.all(np.isfinite(y)), y
        others = np.delete(np.arange(64), [5, 40])
        np.testing.assert_array_equal(y[others], 0.0)
        step = np.float32(tiny) / (127 if bits == 8 else 7)
        assert abs(y[5] - np.float32(tiny)) <= step * 1.01 + 1.5e-45, (y[5], tiny)
        assert abs(y[40] + np.float32(tiny / 2)) <= step * 1.01 + 1.5e-45, (y[40], tiny)
