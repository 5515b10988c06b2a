//! The element types a kernel reads and writes; arithmetic is always in f32.

/// A tensor element: converted to f32 on load and back on store.
pub trait Element: Copy + Send + Sync + 'static {
    /// True for [`Bf16`]: SIMD loads widen it by a shift instead of reading f32.
    const BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

/// bfloat16 as its bit pattern: the upper half of an f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }

    /// Round to nearest, ties to even (what torch does); NaN stays NaN.
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        // Both results, then a select: no branch, so loops over it vectorize.
        let bits = value.to_bits();
        let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
        let quiet_nan = ((bits >> 16) as u16) | 0x0040;
        Bf16(if value.is_nan() { quiet_nan } else { rounded })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trips_exact_values_and_rounds_ties_to_even() {
        for v in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            65280.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(Bf16::from_f32(v).to_f32().to_bits(), v.to_bits());
        }
        // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        // 1 + 3 * 2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).to_f32(), 1.0 + 1.0 / 64.0);
        // Just above a tie rounds up.
        assert_eq!(
            Bf16::from_f32(1.0 + 1.0 / 256.0 + 1e-6).to_f32(),
            1.0 + 1.0 / 128.0
        );
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }
}
