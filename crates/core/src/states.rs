//! The precision of the AdamW moments (`--optim-states`): how many bytes one moment of `n`
//! elements takes in a store record, a device state slot or a checkpoint. The master weights are
//! fp32 whatever the choice; mt-optim owns the encoding, this is only its sizes.

use std::fmt;
use std::str::FromStr;

/// Elements of one block of an 8-bit moment: one f32 scale per block (`docs/decisions/0033`).
pub const Q8_BLOCK: usize = 256;

/// How the AdamW moments `m` and `v` are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum StateDtype {
    /// fp32 moments (8 B/param): the update is bitwise torch's fp32 AdamW.
    #[default]
    F32,
    /// bf16 moments (4 B/param), rounded stochastically.
    Bf16,
    /// 8-bit moments (2 B/param + 8 B per [`Q8_BLOCK`]): blockwise-quantised with an f32
    /// scale per block, nonlinear codes.
    Int8,
}

impl StateDtype {
    /// Every choice, in the order the flag lists them.
    pub const ALL: [StateDtype; 3] = [StateDtype::F32, StateDtype::Bf16, StateDtype::Int8];

    /// Bytes of one moment of `n` elements, a multiple of 4 (so the moments of a device state
    /// slot, `[master | m | v]`, stay f32 words): fp32 `4n`; bf16 `2n` rounded up; int8 the
    /// codes (`n` bytes rounded up) then one f32 scale per block.
    pub fn moment_bytes(self, n: usize) -> usize {
        match self {
            StateDtype::F32 => 4 * n,
            StateDtype::Bf16 => (2 * n).next_multiple_of(4),
            StateDtype::Int8 => n.next_multiple_of(4) + 4 * n.div_ceil(Q8_BLOCK),
        }
    }

    /// Byte offset of an int8 moment's scales within it (its codes' bytes, rounded up to 4).
    pub fn scales_offset(n: usize) -> usize {
        n.next_multiple_of(4)
    }

    /// f32 words of a device state slot for `n` parameters: the master and both moments.
    pub fn state_words(self, n: usize) -> usize {
        n + 2 * self.moment_bytes(n) / 4
    }

    /// Bytes of master weights and moments for `n` parameters (a state slot's, unpadded).
    pub fn state_bytes(self, n: usize) -> usize {
        4 * self.state_words(n)
    }

    /// Nominal bytes per parameter of the master and both moments (12, 8, 6): what the B/param
    /// figures count; an int8 moment's scales add `8 / Q8_BLOCK` more.
    pub fn nominal_state_bytes(self) -> u64 {
        match self {
            StateDtype::F32 => 12,
            StateDtype::Bf16 => 8,
            StateDtype::Int8 => 6,
        }
    }

    /// The flag's spelling: `fp32`, `bf16` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            StateDtype::F32 => "fp32",
            StateDtype::Bf16 => "bf16",
            StateDtype::Int8 => "int8",
        }
    }

    /// Header code (0 is read as fp32: stores written before the field existed).
    pub fn code(self) -> u32 {
        match self {
            StateDtype::F32 => 1,
            StateDtype::Bf16 => 2,
            StateDtype::Int8 => 3,
        }
    }

    /// The first element of a moment of `n` elements (`bytes`: its encoding, in memory order)
    /// that is not finite, and its value: an fp32 or bf16 element that is NaN or infinite, or
    /// the first element of an 8-bit block whose step is (the codes themselves are always
    /// finite). The checkpoint writer's last check before a state goes to disk.
    pub fn first_non_finite(self, n: usize, bytes: &[u8]) -> Option<(usize, f32)> {
        let word = |b: &[u8]| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        match self {
            StateDtype::F32 => {
                bytes.chunks_exact(4).take(n).map(word).enumerate().find(|(_, x)| !x.is_finite())
            }
            StateDtype::Bf16 => bytes
                .chunks_exact(2)
                .take(n)
                .map(|b| f32::from_bits(u32::from(u16::from_ne_bytes([b[0], b[1]])) << 16))
                .enumerate()
                .find(|(_, x)| !x.is_finite()),
            StateDtype::Int8 => bytes[Self::scales_offset(n)..]
                .chunks_exact(4)
                .take(n.div_ceil(Q8_BLOCK))
                .map(word)
                .enumerate()
                .find(|(_, s)| !s.is_finite())
                .map(|(k, s)| (k * Q8_BLOCK, s)),
        }
    }

    /// The dtype of a header code, `None` for an unknown one.
    pub fn from_code(c: u32) -> Option<Self> {
        match c {
            0 | 1 => Some(StateDtype::F32),
            2 => Some(StateDtype::Bf16),
            3 => Some(StateDtype::Int8),
            _ => None,
        }
    }
}

impl fmt::Display for StateDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StateDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" | "f32" => Ok(StateDtype::F32),
            "bf16" => Ok(StateDtype::Bf16),
            "int8" => Ok(StateDtype::Int8),
            other => Err(format!("optimizer states {other:?}: use fp32, bf16 or int8")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_words_and_match_the_nominal_bytes() {
        for d in StateDtype::ALL {
            for n in [0, 1, 3, 255, 256, 257, 1 << 20] {
                assert_eq!(d.moment_bytes(n) % 4, 0, "{d} {n}");
            }
        }
        let n = 1 << 20;
        assert_eq!(StateDtype::F32.state_bytes(n), 12 * n);
        assert_eq!(StateDtype::Bf16.state_bytes(n), 8 * n);
        assert_eq!(StateDtype::Int8.state_bytes(n), 6 * n + 8 * n / Q8_BLOCK);
        assert_eq!(StateDtype::Int8.moment_bytes(257), 260 + 8);
        assert_eq!(StateDtype::Bf16.moment_bytes(3), 8);
    }

    #[test]
    fn names_and_codes_round_trip() {
        for d in StateDtype::ALL {
            assert_eq!(d.name().parse::<StateDtype>(), Ok(d));
            assert_eq!(StateDtype::from_code(d.code()), Some(d));
        }
        assert_eq!(StateDtype::from_code(0), Some(StateDtype::F32));
        assert_eq!(StateDtype::from_code(9), None);
        assert!("fp8".parse::<StateDtype>().unwrap_err().contains("fp32, bf16 or int8"));
    }

    #[test]
    fn non_finite_elements_are_found_in_every_encoding() {
        let n = 600;
        for d in StateDtype::ALL {
            let clean = vec![0u8; d.moment_bytes(n)];
            assert_eq!(d.first_non_finite(n, &clean), None, "{d}");
        }
        let mut f = vec![0u8; StateDtype::F32.moment_bytes(n)];
        f[4 * 7..4 * 8].copy_from_slice(&f32::NAN.to_ne_bytes());
        assert!(StateDtype::F32.first_non_finite(n, &f).is_some_and(|(at, x)| at == 7 && x.is_nan()));
        let mut b = vec![0u8; StateDtype::Bf16.moment_bytes(n)];
        b[2 * 9..2 * 10].copy_from_slice(&0xFF80u16.to_ne_bytes());
        assert_eq!(StateDtype::Bf16.first_non_finite(n, &b), Some((9, f32::NEG_INFINITY)));
        let mut q = vec![0xFFu8; StateDtype::Int8.moment_bytes(n)];
        let scales = StateDtype::scales_offset(n);
        q[scales..].fill(0);
        assert_eq!(StateDtype::Int8.first_non_finite(n, &q), None, "codes are never non-finite");
        q[scales + 8..scales + 12].copy_from_slice(&f32::INFINITY.to_ne_bytes());
        assert_eq!(StateDtype::Int8.first_non_finite(n, &q), Some((2 * Q8_BLOCK, f32::INFINITY)));
    }
}
