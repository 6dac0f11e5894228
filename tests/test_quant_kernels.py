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
