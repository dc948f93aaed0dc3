//! Bit-exact conversions between f32 and the 16-bit float formats (round to nearest,
//! ties to even), written out so results are the same on every platform.

pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    match exp {
        0 => sign * (man as f32) * (1.0 / 16_777_216.0),
        0x1f => f32::from_bits(((h as u32 & 0x8000) << 16) | 0x7f80_0000 | (man << 13)),
        _ => f32::from_bits(((h as u32 & 0x8000) << 16) | ((exp + 112) << 23) | (man << 13)),
    }
}

pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let (h, rem, half) = (m >> shift, m & ((1 << shift) - 1), 1u32 << (shift - 1));
        let h = if rem > half || (rem == half && h & 1 == 1) {
            h + 1
        } else {
            h
        };
        return sign | h as u16;
    }
    let h = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let h = if rem > 0x1000 || (rem == 0x1000 && h & 1 == 1) {
        h + 1
    } else {
        h
    };
    sign | h as u16
}

/// `x` rounded to the precision of `dtype` (floats; other dtypes unchanged).
pub fn round_to(dtype: weft_ir::DType, x: f64) -> f64 {
    use weft_ir::DType;
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::BF16 => bf16_to_f32(f32_to_bf16(x as f32)) as f64,
        DType::F16 => f16_to_f32(f32_to_f16(x as f32)) as f64,
        _ => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
    }

    #[test]
    fn f16_round_trips_and_rounds() {
        for h in [
            0u16, 0x3c00, 0xbc00, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0x5640,
        ] {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#x}");
        }
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds up to infinity
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie to even
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0); // tie to even (zero)
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-26)), 0x0001);
    }
}
