//! Sizes on the command line and in the config: `4096`, `512K`, `8M`, `1.5G`, `2T`
//! (powers of 1024; `KiB` ... `PiB` too, and a trailing `B` on a plain number).
//! `10GB` is refused rather than guessed: disk vendors and parted read it as 10^10
//! bytes, LVM and most tools as 10 GiB, and a size silently off by 7% is worse than
//! a message.

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    if ["KB", "MB", "GB", "TB", "PB"]
        .iter()
        .any(|u| upper.ends_with(u))
    {
        let unit = &t[t.len() - 2..t.len() - 1];
        return Err(format!(
            "size {s:?} is ambiguous (powers of 1000 or of 1024?): write {n}{unit} or \
             {n}{unit}iB for powers of 1024, or the number of bytes",
            n = &t[..t.len() - 2]
        ));
    }
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some(c @ ('k' | 'K' | 'm' | 'M' | 'g' | 'G' | 't' | 'T' | 'p' | 'P')) => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => 50,
            };
            (&t[..t.len() - 1], 1u64 << shift)
        }
        _ => (t, 1),
    };
    let bad = || format!("invalid size {s:?} (examples: 4096, 512K, 8M, 1.5G, 2T)");
    if num.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(bad);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    if !f.is_finite() || f < 0.0 || f * mult as f64 > u64::MAX as f64 {
        return Err(bad());
    }
    Ok((f * mult as f64).round() as u64)
}

/// A size for people: `8.0 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("8M"), Ok(8 << 20));
        assert_eq!(parse_size("8MiB"), Ok(8 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("99999999999999999999T").is_err());
        assert_eq!(parse_size("4096B"), Ok(4096));
        assert_eq!(parse_size("2KiB"), Ok(2048));
        for ambiguous in ["10GB", "10gb", "1.5TB", "512KB", "8Mb"] {
            let e = parse_size(ambiguous).unwrap_err();
            assert!(e.contains("ambiguous"), "{ambiguous}: {e}");
        }
        assert!(parse_size("10GB")
            .unwrap_err()
            .contains("write 10G or 10GiB"));
        assert_eq!(human(8 << 30), "8.0 GiB");
    }
}
