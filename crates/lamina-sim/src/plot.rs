//! Minimal SVG line charts: axes with ticks, several labelled lines, a legend.

use std::fmt::Write;

/// One line of a chart.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Dashed (for reference curves such as a model).
    pub dashed: bool,
}

const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn nice_step(span: f64, target: usize) -> f64 {
    let raw = span / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let step = if norm < 1.5 {
        1.0
    } else if norm < 3.0 {
        2.0
    } else if norm < 7.0 {
        5.0
    } else {
        10.0
    };
    step * mag
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{:.0}M", v / 1e6)
    } else if v.abs() >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders a chart as an SVG document.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, lines: &[Line]) -> String {
    let (w, h) = (760.0, 440.0);
    let (ml, mr, mt, mb) = (70.0, 190.0, 40.0, 55.0);
    let pts = lines.iter().flat_map(|l| l.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    // The y axis starts at 1 (no amplification) or lower.
    if y0 >= 0.0 {
        y0 = y0.min(1.0);
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    let ystep = nice_step(y1 - y0, 6);
    y0 = (y0 / ystep).floor() * ystep;
    y1 = (y1 / ystep).ceil() * ystep;
    let xstep = nice_step(x1 - x0, 8);
    let pw = w - ml - mr;
    let ph = h - mt - mb;
    let sx = |x: f64| ml + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| mt + ph - (y - y0) / (y1 - y0) * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">
<rect width="{w}" height="{h}" fill="white"/>
<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>
"##,
        ml + pw / 2.0,
        esc(title)
    );
    let mut y = y0;
    while y <= y1 + ystep * 1e-6 {
        let _ = writeln!(
            s,
            r##"<line x1="{ml}" x2="{0}" y1="{1}" y2="{1}" stroke="#e5e5e5"/><text x="{2}" y="{3}" text-anchor="end">{4}</text>"##,
            ml + pw,
            sy(y),
            ml - 6.0,
            sy(y) + 4.0,
            fmt_tick(y)
        );
        y += ystep;
    }
    let mut x = (x0 / xstep).ceil() * xstep;
    while x <= x1 + xstep * 1e-6 {
        let _ = writeln!(
            s,
            r##"<line x1="{0}" x2="{0}" y1="{mt}" y2="{1}" stroke="#f0f0f0"/><text x="{0}" y="{2}" text-anchor="middle">{3}</text>"##,
            sx(x),
            mt + ph,
            mt + ph + 18.0,
            fmt_tick(x)
        );
        x += xstep;
    }
    let _ = writeln!(
        s,
        r##"<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>"##,
        ml + pw / 2.0,
        h - 12.0,
        esc(x_label),
        mt + ph / 2.0,
        mt + ph / 2.0,
        esc(y_label)
    );
    for (i, l) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let d: Vec<String> = l
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let dash = if l.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
            d.join(" ")
        );
        if l.points.len() <= 12 {
            for &(x, y) in &l.points {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                    sx(x),
                    sy(y)
                );
            }
        }
        let ly = mt + 10.0 + i as f64 * 18.0;
        let _ = writeln!(
            s,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
            w - mr + 12.0,
            w - mr + 36.0,
            w - mr + 42.0,
            ly + 4.0,
            esc(&l.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_valid_looking_svg() {
        let svg = line_chart(
            "WA <vs> OP",
            "over-provisioning",
            "WA",
            &[
                Line {
                    label: "greedy".into(),
                    points: vec![(0.07, 7.8), (0.28, 2.5), (0.5, 1.7)],
                    dashed: false,
                },
                Line {
                    label: "model".into(),
                    points: vec![(0.07, 7.82), (0.5, 1.72)],
                    dashed: true,
                },
            ],
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("&lt;vs&gt;"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("stroke-dasharray"));
    }
}
