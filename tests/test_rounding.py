"""Mantissa rounding to a relative L2 target (lcckpt.codec.rounding), and the lossy
numcodecs codec that takes it where the uniform quantizer's symbols cannot span an array."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lcckpt
from lcckpt.codec.rounding import MANTISSA, _round, rounded
from lcckpt.numcodecs import LcckptLossy

DTYPES = [np.float16, np.float32, np.float64]


def _nearest(x: np.ndarray, keep: int) -> np.ndarray:
    """An independent oracle for normal numbers: the value of ``keep`` mantissa bits
    nearest ``x`` (ties to even), from frexp and numpy's own rounding."""
    m, e = np.frexp(x.astype(np.float64))            # x = m·2^e, 0.5 <= |m| < 1
    return np.ldexp(np.round(m * 2.0 ** (keep + 1)), e - (keep + 1)).astype(x.dtype)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: st.tuples(
    hnp.arrays(dt, st.integers(1, 300), elements=st.floats(
        width=np.dtype(dt).itemsize * 8, allow_nan=True, allow_infinity=True)),
    st.sampled_from([0.3, 1e-2, 1e-3, 1e-4, 1e-6]))))
def test_the_rounded_array_holds_the_target_and_keeps_nan_and_inf(case):
    x, target = case
    y = rounded(x, target)
    if y is None:
        return
    assert y.dtype == x.dtype and y.shape == x.shape
    bad = ~np.isfinite(x)
    bits = f"u{x.dtype.itemsize}"
    assert np.array_equal(y[bad].view(bits), x[bad].view(bits))
    assert np.isfinite(y[~bad]).all()
    x64, y64 = x[~bad].astype(np.float64), y[~bad].astype(np.float64)
    scale = np.max(np.abs(x64))         # no square overflows near fp64's largest
    assert np.linalg.norm((y64 - x64) / scale) <= target * np.linalg.norm(x64 / scale) * (1 + 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [0, 3, 7])
def test_bits_are_rounded_to_nearest_with_ties_to_even(dtype, keep):
    """Against frexp and numpy's rounding, on normal values of either sign, ties
    included (a value halfway between two of ``keep`` bits)."""
    rng = np.random.default_rng(keep)
    x = (rng.standard_normal(5000) * 10.0 ** rng.integers(-3, 3, 5000)).astype(dtype)
    x = x[np.abs(x) >= np.finfo(dtype).tiny]
    assert np.array_equal(_round(x, keep), _nearest(x, keep))
    if keep:                # a tie between 8 and the next value of keep bits: to 8, even
        half = np.ldexp(np.float64(1 + 2.0 ** -(keep + 1)), 3).astype(dtype)
        assert np.array_equal(_round(np.array([half, -half]), keep), [8.0, -8.0])


def test_the_largest_finite_value_is_not_rounded_to_inf():
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float32)
    assert np.array_equal(_round(big, 2), big)


def test_no_rounding_where_none_can_go():
    x = np.ones(10, np.float32)
    assert rounded(x, 2.0 ** -30) is None               # every fp32 bit needed
    assert rounded(x.astype(np.int32), 1e-2) is None
    assert rounded(np.ones(0, np.float32), 1e-2) is None
    assert MANTISSA[np.dtype(np.float32)] == 23


def test_an_ordinary_array_at_a_fine_target_is_rounded_not_stored_exactly():
    """At 1e-4 a Gaussian array spans thousands of the quantizer's steps: its blob was
    the exact one; rounded to 12-13 mantissa bits it is far smaller, within the target;
    NaN fill values come back as they were."""
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    x[:1000] = np.nan
    exact = len(lcckpt.encode(x, lossless=True))
    codec = LcckptLossy()                               # target 1e-4
    blob = codec.encode(x)
    y = codec.decode(blob)
    assert len(blob) < 0.7 * exact
    assert np.isnan(y[:1000]).all()
    x64, y64 = x[1000:].astype(np.float64), y[1000:].astype(np.float64)
    assert np.linalg.norm(y64 - x64) <= 1e-4 * np.linalg.norm(x64)
    coarse = LcckptLossy(target=1e-2)                   # the quantizer's blob is smaller
    assert len(coarse.encode(x[1000:])) == len(lcckpt.encode(x[1000:], target=1e-2))


def test_a_coarse_target_never_drops_exponent_bits():
    """At a target that allows more bits to go than the mantissa's first ones, rounding
    stops at no mantissa bit: values stay within a factor of two of themselves."""
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    for target in (0.3, 0.49, 0.9):
        y = rounded(x, target)
        assert y is not None and np.all(np.abs(y) >= np.abs(x) / 2) and np.all(np.abs(y) <= 2 * np.abs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_errors_are_numpy_s_sums_of_the_rounded_differences(dtype):
    """The kernel's one read against the rounded copies themselves, in float64, with
    NaN, Inf, the largest value (which rounds up to Inf and is kept) and subnormals
    (whose rounding may carry into the first normal binade)."""
    from lcckpt.codec.kernels.rounding import rounding_errors
    rng = np.random.default_rng(7)
    info = np.finfo(dtype)
    x = (rng.standard_normal(20_000) * 2.0 ** rng.integers(-8, 8, 20_000)).astype(dtype)
    x[:8] = [np.nan, np.inf, -np.inf, info.max, -info.max, info.tiny / 3, -info.tiny * 0.99,
             info.tiny * (1 - 2.0 ** -(MANTISSA[np.dtype(dtype)] + 1))]
    finite = np.isfinite(x)
    mant = MANTISSA[np.dtype(dtype)]
    ebits = 8 * x.itemsize - 1 - mant
    bias = (1 << (ebits - 1)) - 1
    scale = 2.0 ** 600 if dtype == np.float64 else 1.0     # no square overflows
    ulp = np.ldexp(1.0, np.maximum(np.arange((1 << ebits) - 1), 1) - bias - mant) / scale
    keeps = np.array([9, 4, 1, 0])
    sums = np.zeros(keeps.size + 1)
    rounding_errors(x.view(f"u{x.itemsize}"), mant, ebits, keeps, ulp, sums)
    x64 = x[finite].astype(np.float64) / scale
    want = [np.sum((_round(x, int(k))[finite].astype(np.float64) / scale - x64) ** 2) for k in keeps]
    assert np.allclose(sums[:-1], want, rtol=1e-12, atol=0)
    assert np.isclose(sums[-1], np.sum(x64 ** 2), rtol=1e-12)
