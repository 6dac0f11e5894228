"""The erasure-code kernels (src_cython/mpilossy_fec.h) against references
written here: XOR parity for m = 1, a Cauchy Reed-Solomon code over GF(2^8)
in NumPy for m >= 2, and every erasure pattern of a small group rebuilt."""

import itertools

import numpy as np
import pytest

from mpilossy import _core

needs_isal = pytest.mark.skipif(not _core.HAVE_ISAL,
                                reason="built without Intel ISA-L: m >= 2 absent")


def group_of(k, m, length, seed=0):
    rng = np.random.default_rng(seed)
    g = np.zeros((k + m) * length, np.uint8)
    g[:k * length] = rng.integers(0, 256, k * length, np.uint8)
    return g


def gf_tables():
    """exp/log of GF(2^8) with the polynomial x^8 + x^4 + x^3 + x^2 + 1."""
    exp = np.zeros(512, np.int64)
    log = np.zeros(256, np.int64)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    exp[255:510] = exp[:255]
    return exp, log


def cauchy_parity(data, k, m):
    """Parity row i (0..m-1) = sum_j data_j / ((k + i) xor j) over GF(2^8)."""
    exp, log = gf_tables()
    out = np.zeros((m, data.shape[1]), np.uint8)
    for i in range(m):
        for j in range(k):
            coef_log = (255 - log[(k + i) ^ j]) % 255          # log of the inverse
            d = data[j].astype(np.int64)
            prod = np.where(d == 0, 0, exp[(log[d] + coef_log) % 255])
            out[i] ^= prod.astype(np.uint8)
    return out


@pytest.mark.parametrize("k", [2, 5, 16, 64])
@pytest.mark.parametrize("length", [1, 31, 33, 4097, 8192])
def test_xor_parity_is_the_xor_and_rebuilds_any_one_block(k, length):
    g = group_of(k, 1, length, seed=k + length)
    assert _core.fec_kernel("encode", g, k, 1) == 1
    rows = g.reshape(k + 1, length)
    np.testing.assert_array_equal(rows[k], np.bitwise_xor.reduce(rows[:k], axis=0))
    original = g.copy()
    for lost in sorted({0, k // 2, k - 1}):
        rows[lost] = 0xA5                           # garbage where the lost block was
        present = np.ones(k + 1, np.uint8)
        present[lost] = 0
        assert _core.fec_kernel("decode", g, k, 1, present) == 1
        np.testing.assert_array_equal(g, original)


def test_nothing_lost_or_only_parity_lost_writes_nothing():
    k, length = 8, 1000
    g = group_of(k, 1, length)
    _core.fec_kernel("encode", g, k, 1)
    before = g.copy()
    present = np.ones(k + 1, np.uint8)
    assert _core.fec_kernel("decode", g, k, 1, present) == 0
    present[k] = 0
    assert _core.fec_kernel("decode", g, k, 1, present) == 0
    np.testing.assert_array_equal(g, before)


@pytest.mark.parametrize("k,m", [(2, 1), (8, 1), (4, 2), (8, 3)])
def test_more_losses_than_parity_are_refused_and_leave_the_group_alone(k, m):
    if _core.fec_check(k, m) is not None:
        pytest.skip(_core.fec_check(k, m))
    g = group_of(k, m, 256)
    _core.fec_kernel("encode", g, k, m)
    before = g.copy()
    present = np.ones(k + m, np.uint8)
    present[:m + 1] = 0
    with pytest.raises(ValueError, match=f"fewer than {k} of the group"):
        _core.fec_kernel("decode", g, k, m, present)
    np.testing.assert_array_equal(g, before)


@needs_isal
@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (8, 2), (16, 4), (64, 8)])
def test_reed_solomon_parity_matches_a_numpy_cauchy_code(k, m):
    length = 517
    g = group_of(k, m, length, seed=k * m)
    _core.fec_kernel("encode", g, k, m)
    rows = g.reshape(k + m, length)
    if m == 1:
        np.testing.assert_array_equal(rows[k], np.bitwise_xor.reduce(rows[:k], axis=0))
    else:
        np.testing.assert_array_equal(rows[k:], cauchy_parity(rows[:k], k, m))


@needs_isal
@pytest.mark.parametrize("k,m", [(4, 2), (5, 3), (6, 2), (16, 2), (12, 4)])
def test_every_erasure_pattern_up_to_m_is_rebuilt(k, m):
    length = 300
    g = group_of(k, m, length, seed=7)
    _core.fec_kernel("encode", g, k, m)
    original = g.copy()
    rows = g.reshape(k + m, length)
    for nlost in range(1, m + 1):
        for lost in itertools.combinations(range(k + m), nlost):
            present = np.ones(k + m, np.uint8)
            for i in lost:
                present[i] = 0
                rows[i] = 0x5A
            rebuilt = _core.fec_kernel("decode", g, k, m, present)
            assert rebuilt == sum(1 for i in lost if i < k), lost
            for i in lost:
                if i >= k:              # lost parity is not rebuilt: restore for the next round
                    rows[i] = original.reshape(k + m, length)[i]
            np.testing.assert_array_equal(g, original, err_msg=str(lost))


@pytest.mark.parametrize("k,m,words", [(1, 1, "k must be"), (65, 1, "k must be"),
                                       (8, 0, "m must be"), (4, 4, "m must be"),
                                       (16, 9, "m must be")])
def test_codes_out_of_range_are_refused_with_the_reason(k, m, words):
    assert words in _core.fec_check(k, m)
    with pytest.raises(ValueError, match=rf"redundancy=\({k}, {m}\): {words}"):
        _core.fec_kernel("encode", np.zeros((k + m) * 8, np.uint8), k, m)


def test_without_isal_m_above_one_says_what_to_install():
    why = _core.fec_check(8, 2)
    if _core.HAVE_ISAL:
        assert why is None
    else:
        assert "libisal-dev" in why


def test_bad_buffers_are_refused():
    with pytest.raises(ValueError, match="equal blocks"):
        _core.fec_kernel("encode", np.zeros(10, np.uint8), 2, 1)
    ro = np.zeros(12, np.uint8)
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        _core.fec_kernel("encode", ro, 2, 1)
    with pytest.raises(ValueError, match="present must have"):
        _core.fec_kernel("decode", np.zeros(12, np.uint8), 2, 1, np.ones(2, np.uint8))
    with pytest.raises(ValueError, match="needs `present`"):
        _core.fec_kernel("decode", np.zeros(12, np.uint8), 2, 1)


@pytest.mark.parametrize("k,m,filled", [(8, 1, 1), (8, 1, 5), (32, 1, 3), (8, 2, 1), (8, 2, 3),
                                        (16, 4, 7), (64, 8, 9)])
def test_a_short_last_group_codes_as_if_padded_with_zeros_and_never_reads_the_padding(k, m,
                                                                                     filled):
    """A stream's last group holds `filled` < k blocks: its parity is the
    zero-padded group's, and rebuilding never reads the padding rows (the
    core stores nothing there)."""
    if _core.fec_check(k, m) is not None:
        pytest.skip(_core.fec_check(k, m))
    length = 263
    padded = group_of(k, m, length, seed=k + filled)
    rows = padded.reshape(k + m, length)
    rows[filled:k] = 0
    _core.fec_kernel("encode", padded, k, m)
    short = padded.copy()
    srows = short.reshape(k + m, length)
    srows[filled:] = 0x3C                       # garbage in the padding and the parity rows
    assert _core.fec_kernel("encode", short, k, m, filled=filled) == m
    np.testing.assert_array_equal(srows[k:], rows[k:])
    for nlost in range(1, min(m, filled) + 1):
        lost = list(range(0, filled, max(1, filled // nlost)))[:nlost]
        present = np.ones(k + m, np.uint8)
        present[lost] = 0
        srows[lost] = 0x77
        assert _core.fec_kernel("decode", short, k, m, present, filled=filled) == nlost
        np.testing.assert_array_equal(srows[:filled], rows[:filled])
        np.testing.assert_array_equal(srows[filled:k], 0x3C)   # padding left alone
    present = np.ones(k + m, np.uint8)
    present[:min(m, filled)] = 0
    present[k:k + m] = 0                        # every parity row lost too
    with pytest.raises(ValueError, match=f"fewer than {filled} of the group"):
        _core.fec_kernel("decode", short, k, m, present, filled=filled)
    with pytest.raises(ValueError, match="filled must be"):
        _core.fec_kernel("encode", short, k, m, filled=k + 1)
