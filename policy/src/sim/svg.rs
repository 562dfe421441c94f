//! A tiny SVG line-chart writer: enough for time series, no dependencies.

use std::fmt::Write;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Fixed y range; None fits the data.
    pub y_range: Option<(f64, f64)>,
    /// x on a base-2 logarithmic scale, ticked at powers of two (for
    /// counts that double, like 16..4096 connections). Points with x <= 0
    /// are left out.
    pub x_log2: bool,
    pub series: Vec<Series>,
}

const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A "nice" tick step for a range split in about `n` parts.
fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let r = raw / magnitude;
    let nice = if r <= 1.0 {
        1.0
    } else if r <= 2.0 {
        2.0
    } else if r <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

impl Chart {
    pub fn render(&self) -> String {
        let (w, h) = (760.0, 420.0);
        let (left, right, top, bottom) = (70.0, 170.0, 40.0, 50.0);
        let pw = w - left - right;
        let ph = h - top - bottom;
        // Where x lies on the axis: itself, or its base-2 logarithm.
        let log = self.x_log2;
        let ax = move |x: f64| if log { x.log2() } else { x };
        let all = self
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .map(|&(x, y)| (ax(x), y));
        let (mut x0, mut x1, mut y0, mut y1) = (
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::INFINITY,
            f64::NEG_INFINITY,
        );
        for (x, y) in all {
            if x.is_finite() && y.is_finite() {
                x0 = x0.min(x);
                x1 = x1.max(x);
                y0 = y0.min(y);
                y1 = y1.max(y);
            }
        }
        if !x0.is_finite() {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if let Some((lo, hi)) = self.y_range {
            (y0, y1) = (lo, hi);
        } else {
            y0 = y0.min(0.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
        let sx = |x: f64| left + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| top + ph - (y - y0) / (y1 - y0) * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
            left + pw / 2.0,
            escape(&self.title)
        );
        let step = tick_step(y1 - y0, 5.0);
        let mut y = (y0 / step).ceil() * step;
        while y <= y1 + step * 1e-9 {
            let py = sy(y);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/>"##,
                left + pw
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                left - 6.0,
                py + 4.0,
                fmt_tick(y, step)
            );
            y += step;
        }
        let step = if log { 1.0 } else { tick_step(x1 - x0, 8.0) };
        let mut x = (x0 / step).ceil() * step;
        while x <= x1 + step * 1e-9 {
            let px = sx(x);
            let label = if log {
                format!("{:.0}", x.exp2())
            } else {
                fmt_tick(x, step)
            };
            let _ = writeln!(
                s,
                r##"<line x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{:.1}" stroke="#eee"/>"##,
                top + ph
            );
            let _ = writeln!(
                s,
                r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{label}</text>"#,
                top + ph + 16.0,
            );
            x += step;
        }
        let _ = writeln!(
            s,
            r#"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            left + pw / 2.0,
            h - 12.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
            top + ph / 2.0,
            top + ph / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let mut d = String::new();
            for (j, (x, y)) in series
                .points
                .iter()
                .map(|&(x, y)| (ax(x), y))
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .enumerate()
            {
                let _ = write!(
                    d,
                    "{}{:.1},{:.1} ",
                    if j == 0 { "M" } else { "L" },
                    sx(x),
                    sy(y.clamp(y0, y1))
                );
            }
            let _ = writeln!(
                s,
                r#"<path d="{}" fill="none" stroke="{colour}" stroke-width="1.6"/>"#,
                d.trim_end()
            );
            let ly = top + 14.0 + 18.0 * i as f64;
            let lx = left + pw + 12.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/>"#,
                lx + 20.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{}</text>"#,
                lx + 26.0,
                ly + 4.0,
                escape(&series.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

fn fmt_tick(v: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.*}", (-step.log10().floor()) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_path_per_series_and_escapes_text() {
        let chart = Chart {
            title: "a < b".into(),
            x_label: "t".into(),
            y_label: "y".into(),
            y_range: Some((0.0, 1.0)),
            x_log2: false,
            series: vec![
                Series {
                    name: "one".into(),
                    points: vec![(0.0, 0.1), (1.0, 0.9)],
                },
                Series {
                    name: "two".into(),
                    points: vec![(0.0, 0.5), (1.0, f64::NAN)],
                },
            ],
        };
        let svg = chart.render();
        assert_eq!(svg.matches("<path").count(), 2);
        assert!(svg.contains("a &lt; b"));
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn a_log2_axis_is_ticked_at_powers_of_two() {
        let chart = Chart {
            title: "freeze".into(),
            x_label: "connections".into(),
            y_label: "ms".into(),
            y_range: None,
            x_log2: true,
            series: vec![Series {
                name: "median".into(),
                points: vec![(16.0, 40.0), (1024.0, 90.0), (4096.0, 300.0), (0.0, 1.0)],
            }],
        };
        let svg = chart.render();
        for tick in [16, 32, 64, 128, 256, 512, 1024, 2048, 4096] {
            assert!(svg.contains(&format!(">{tick}</text>")), "{tick} missing");
        }
        assert!(!svg.contains(">8</text>") && !svg.contains(">8192</text>"));
        // The point at 0 has no logarithm: left out, not drawn at -inf.
        assert!(!svg.contains("inf") && !svg.contains("NaN"));
        assert_eq!(svg.matches(" L").count(), 2, "{svg}");
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(100.0, 5.0), 20.0);
        assert_eq!(tick_step(1.0, 5.0), 0.2);
        assert_eq!(tick_step(900.0, 8.0), 200.0);
    }
}
