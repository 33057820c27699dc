//! The learning-rate schedule: linear warmup, then constant, linear decay to 0 (as transformers'
//! `get_linear_schedule_with_warmup`) or cosine decay to 10% of the peak, as a pure function of
//! the global step (so a resumed run continues the same curve).

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Hold the peak rate.
    Constant,
    /// Cosine decay from the peak rate to [`COSINE_FLOOR`] of it.
    Cosine,
    /// Linear decay from the peak rate to 0 at the end of the schedule.
    Linear,
}

impl ScheduleKind {
    /// The flag's value: `constant`, `cosine` or `linear`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Cosine => "cosine",
            ScheduleKind::Linear => "linear",
        }
    }
}

/// Fraction of the peak rate that the cosine schedule decays to.
pub const COSINE_FLOOR: f64 = 0.1;

/// A learning-rate schedule over global steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub peak: f64,
    /// Warmup steps: step `k < warmup` runs at `peak * (k + 1) / warmup`.
    pub warmup: u64,
    /// Length of the schedule: the cosine reaches its floor at this step and stays there.
    pub total: u64,
    /// Shape after warmup.
    pub kind: ScheduleKind,
}

impl LrSchedule {
    /// The learning rate of global step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.peak,
            ScheduleKind::Linear => {
                let span = self.total.saturating_sub(self.warmup).max(1);
                self.peak * (self.total.saturating_sub(step) as f64 / span as f64).min(1.0)
            }
            ScheduleKind::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1);
                let p = ((step - self.warmup) as f64 / span as f64).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
                self.peak * (COSINE_FLOOR + (1.0 - COSINE_FLOOR) * cos)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_then_the_peak() {
        let s = LrSchedule { peak: 1.0, warmup: 4, total: 100, kind: ScheduleKind::Constant };
        let lrs: Vec<f64> = (0..6).map(|k| s.lr(k)).collect();
        assert_eq!(lrs, vec![0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn cosine_falls_monotonically_to_the_floor() {
        let s = LrSchedule { peak: 2.0, warmup: 2, total: 12, kind: ScheduleKind::Cosine };
        assert_eq!(s.lr(2), 2.0);
        assert!((s.lr(7) - 2.0 * 0.55).abs() < 1e-12, "halfway: {}", s.lr(7));
        assert!((2..20).all(|k| s.lr(k + 1) <= s.lr(k)));
        assert!((s.lr(12) - 0.2).abs() < 1e-12 && s.lr(50) == s.lr(12));
    }

    #[test]
    fn linear_falls_from_the_peak_to_zero_at_the_end() {
        let s = LrSchedule { peak: 1.0, warmup: 2, total: 10, kind: ScheduleKind::Linear };
        let lrs: Vec<f64> = (0..12).map(|k| s.lr(k)).collect();
        assert_eq!(&lrs[..3], &[0.5, 1.0, 1.0]);
        assert_eq!(lrs[6], 0.5);
        assert_eq!(&lrs[9..], &[0.125, 0.0, 0.0]);
    }

    #[test]
    fn no_warmup_and_a_schedule_shorter_than_warmup_are_fine() {
        let s = LrSchedule { peak: 1.0, warmup: 0, total: 0, kind: ScheduleKind::Cosine };
        assert!(s.lr(0).is_finite() && s.lr(0) > 0.0);
        let s = LrSchedule { peak: 1.0, warmup: 5, total: 3, kind: ScheduleKind::Cosine };
        assert!((0..10).all(|k| s.lr(k).is_finite()));
    }
}
