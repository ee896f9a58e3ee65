//! Line charts as SVG (the `plotters` crate): axes with ticks, several labelled
//! lines, a legend; reference curves (a model) dashed.

use plotters::prelude::*;
use plotters::series::DashedLineSeries;

/// One line of a chart.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Dashed (for reference curves such as a model).
    pub dashed: bool,
}

const COLORS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// The axes' ranges: every finite point inside, y from 1 (no amplification) or
/// lower when nothing is negative, and never empty.
fn ranges(lines: &[Line]) -> ((f64, f64), (f64, f64)) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in lines.iter().flat_map(|l| l.points.iter()) {
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
    if y0 >= 0.0 {
        y0 = y0.min(1.0);
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    // A little room above the highest point.
    ((x0, x1), (y0, y1 + (y1 - y0) * 0.05))
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

/// Renders a chart as an SVG document.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, lines: &[Line]) -> String {
    let mut svg = String::new();
    // Drawing into a String cannot fail for lack of space or a font (the SVG
    // backend writes text as <text>); an error here is a bug in the chart's setup.
    draw(&mut svg, title, x_label, y_label, lines).expect("chart drawing failed");
    svg
}

fn draw(
    svg: &mut String,
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
) -> Result<(), String> {
    let ((x0, x1), (y0, y1)) = ranges(lines);
    let root = SVGBackend::with_string(svg, (760, 440)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|v| fmt_tick(*v))
        .y_label_formatter(&|v| fmt_tick(*v))
        .max_light_lines(1)
        .light_line_style(RGBColor(0xf0, 0xf0, 0xf0))
        .draw()
        .map_err(e)?;
    for (i, l) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let style = color.stroke_width(2);
        let points: Vec<(f64, f64)> = l
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], style);
        if l.dashed {
            chart
                .draw_series(DashedLineSeries::new(points.clone(), 6, 4, style))
                .map_err(e)?
                .label(l.label.as_str())
                .legend(legend);
        } else {
            chart
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(e)?
                .label(l.label.as_str())
                .legend(legend);
        }
        // Few points: mark each, so that a reader sees where the measurements are.
        if points.len() <= 12 {
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(e)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
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
        // One solid line, the dashed one as segments, a marker per point, and the
        // legend naming both.
        assert!(svg.matches("<polyline").count() >= 2);
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains("greedy") && svg.contains("model"));
        assert!(svg.contains("over-provisioning"));
    }
}

#[cfg(test)]
mod range_tests {
    use super::*;

    #[test]
    fn axes_hold_every_point_and_start_at_one_at_most() {
        let l = |points: Vec<(f64, f64)>| Line {
            label: "l".into(),
            points,
            dashed: false,
        };
        let ((x0, x1), (y0, y1)) = ranges(&[l(vec![(0.1, 2.5), (0.5, 7.0), (f64::NAN, 99.0)])]);
        assert_eq!((x0, x1), (0.1, 0.5));
        assert_eq!(y0, 1.0);
        assert!((7.0..99.0).contains(&y1));
        // Nothing to show: still a valid range.
        let ((x0, x1), (y0, y1)) = ranges(&[l(vec![])]);
        assert!(x1 > x0 && y1 > y0);
    }
}
