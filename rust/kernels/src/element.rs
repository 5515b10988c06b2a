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

/// IEEE half precision as its bit pattern (GGUF's block scales).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl F16 {
    /// Exact: every f16 value is an f32 value.
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        let sign = u32::from(self.0 >> 15) << 31;
        let exp = u32::from((self.0 >> 10) & 0x1f);
        let mant = u32::from(self.0 & 0x3ff);
        let bits = match (exp, mant) {
            (0, 0) => sign,
            // Subnormal: mant * 2^-24.
            (0, _) => {
                let v = (mant as f32) * f32::from_bits(0x3380_0000);
                return if sign != 0 { -v } else { v };
            }
            (0x1f, 0) => sign | 0x7f80_0000,
            (0x1f, _) => sign | 0x7fc0_0000 | (mant << 13),
            _ => sign | ((exp + 112) << 23) | (mant << 13),
        };
        f32::from_bits(bits)
    }

    /// Round to nearest, ties to even; overflow to infinity.
    pub fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let abs = value.abs();
        if abs.is_nan() {
            return F16(sign | 0x7e00);
        }
        if abs >= 65520.0 {
            return F16(sign | 0x7c00);
        }
        if abs < f32::from_bits(0x3880_0000) {
            // Below the smallest normal (2^-14): a multiple of 2^-24, rounded to even.
            let units = abs * f32::from_bits(0x4b80_0000); // * 2^24
            return F16(sign | units.round_ties_even() as u16);
        }
        let exp = ((abs.to_bits() >> 23) as i32 - 127 + 15) as u32;
        let mant = abs.to_bits() & 0x7f_ffff;
        let mut half = (exp << 10) | (mant >> 13);
        let rest = mant & 0x1fff;
        if rest > 0x1000 || (rest == 0x1000 && half & 1 == 1) {
            half += 1; // may carry into the exponent, which is right
        }
        F16(sign | half as u16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_converts_every_pattern_exactly_and_rounds_to_nearest_even() {
        for bits in 0..=u16::MAX {
            let h = F16(bits);
            let v = h.to_f32();
            if v.is_nan() {
                assert!(F16::from_f32(v).to_f32().is_nan());
            } else {
                // Every f16 value converts to f32 and back to itself.
                assert_eq!(F16::from_f32(v), h, "{bits:#06x} -> {v}");
            }
        }
        assert_eq!(F16::from_f32(1.0).0, 0x3c00);
        assert_eq!(F16::from_f32(-2.0).0, 0xc000);
        assert_eq!(F16::from_f32(65504.0).0, 0x7bff);
        assert_eq!(F16::from_f32(1e6).0, 0x7c00);
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (down to 1).
        assert_eq!(F16::from_f32(1.0 + 2f32.powi(-11)).0, 0x3c00);
        assert_eq!(F16::from_f32(1.0 + 3.0 * 2f32.powi(-11)).0, 0x3c02);
        assert_eq!(F16(0x0001).to_f32(), 2f32.powi(-24));
        assert_eq!(F16(0x8001).to_f32(), -(2f32.powi(-24)));
    }

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
