//! Sizes in the unit they ask for: decimal (`B`, `KB`, `MB`, `GB`, `TB`, as disks and files are
//! sold and as `ls -lh --si` shows them) for files, and binary (`KiB`, `MiB`, `GiB`) for memory,
//! with three significant digits, so a small model's sizes are never shown as "0.00 GB".

/// `bytes` in decimal units: `512 B`, `791 KB`, `12.8 MB`, `3.15 GB`.
pub fn bytes(bytes: f64) -> String {
    scaled(bytes, 1000.0, &["B", "KB", "MB", "GB", "TB", "PB"])
}

/// `bytes` in binary units: `512 B`, `773 KiB`, `12.2 MiB`, `2.93 GiB`.
pub fn bytes_binary(bytes: f64) -> String {
    scaled(bytes, 1024.0, &["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
}

fn scaled(mut x: f64, base: f64, units: &[&str]) -> String {
    if !x.is_finite() {
        return format!("{x} B");
    }
    let mut u = 0;
    // 999.6 KB rounds to "1000 KB": move up once it would.
    while x.abs() >= base - 0.5 && u + 1 < units.len() {
        x /= base;
        u += 1;
    }
    if u == 0 {
        return format!("{x:.0} B");
    }
    let digits = if x.abs() < 9.995 {
        2
    } else if x.abs() < 99.95 {
        1
    } else {
        0
    };
    format!("{x:.digits$} {}", units[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_the_unit_they_ask_for() {
        assert_eq!(bytes(0.0), "0 B");
        assert_eq!(bytes(999.0), "999 B");
        assert_eq!(bytes(1000.0), "1.00 KB");
        assert_eq!(bytes(791_680.0), "792 KB");
        assert_eq!(bytes(12_750_000.0), "12.8 MB");
        assert_eq!(bytes(999_700.0), "1.00 MB");
        assert_eq!(bytes(3.15e9), "3.15 GB");
        assert_eq!(bytes(2.6e12), "2.60 TB");
        assert_eq!(bytes_binary(1023.0), "1023 B");
        assert_eq!(bytes_binary(3.0 * (1u64 << 30) as f64), "3.00 GiB");
        assert_eq!(bytes_binary(12.5 * 1048576.0), "12.5 MiB");
    }
}
