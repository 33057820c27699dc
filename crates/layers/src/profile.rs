//! Opt-in section profiler of the templates (`MT_PROFILE=1`): at each section boundary the device
//! is synchronised and the wall time since the previous boundary is added to that section's
//! total. Synchronising serialises the device with the host, so a profiled run is slower than a
//! normal one; the totals say where the device's time goes, not how fast a step is. Off (one
//! relaxed load per boundary) unless the variable is set.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::Device;

static STATE: AtomicU8 = AtomicU8::new(0); // 0 = unknown, 1 = off, 2 = on
static TOTALS: Mutex<BTreeMap<&'static str, (u64, f64)>> = Mutex::new(BTreeMap::new());
static LAST: Mutex<Option<Instant>> = Mutex::new(None);

/// Whether `MT_PROFILE` is set (to anything but `0`).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var("MT_PROFILE").is_ok_and(|v| v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// Starts timing a new section sequence (synchronises first).
pub(crate) fn start(device: &Device) {
    if enabled() {
        let _ = device.synchronize();
        *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }
}

/// Ends section `name`: synchronises, adds the time since the previous boundary to it.
pub(crate) fn mark(device: &Device, name: &'static str) {
    if !enabled() {
        return;
    }
    let _ = device.synchronize();
    let now = Instant::now();
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = last.replace(now) {
        let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
        let e = totals.entry(name).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += (now - t).as_secs_f64();
    }
}

/// Section totals so far, `(name, count, seconds)`, largest first; clears them.
pub fn take() -> Vec<(&'static str, u64, f64)> {
    let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    let mut v: Vec<_> = totals.iter().map(|(k, (n, s))| (*k, *n, *s)).collect();
    totals.clear();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v
}
