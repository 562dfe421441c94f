//! Plain-text tables and CSV.

/// A table rendered with aligned columns.
pub fn text_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.len());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            let w = widths.get(i).copied().unwrap_or(0);
            if i == 0 {
                s.push_str(&format!("{c:<w$}"));
            } else {
                s.push_str(&format!("{c:>w$}"));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    out.push_str(&line(
        widths
            .iter()
            .map(|&w| "-".repeat(w))
            .collect::<Vec<_>>()
            .iter()
            .map(|s| s.as_str())
            .collect(),
    ));
    for row in rows {
        out.push_str(&line(row.iter().map(|s| s.as_str()).collect()));
    }
    out
}

/// CSV with minimal quoting (fields containing a comma or quote).
pub fn csv(header: &[&str], rows: &[Vec<String>]) -> String {
    let field = |f: &str| {
        if f.contains(',') || f.contains('"') {
            format!("\"{}\"", f.replace('"', "\"\""))
        } else {
            f.to_string()
        }
    };
    let mut out = header
        .iter()
        .map(|h| field(h))
        .collect::<Vec<_>>()
        .join(",");
    out.push('\n');
    for row in rows {
        out.push_str(&row.iter().map(|c| field(c)).collect::<Vec<_>>().join(","));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_what_needs_it() {
        let s = csv(&["a", "b"], &[vec!["1,2".into(), "x\"y".into()]]);
        assert_eq!(s, "a,b\n\"1,2\",\"x\"\"y\"\n");
    }

    #[test]
    fn table_aligns_columns() {
        let t = text_table(&["name", "v"], &[vec!["long name".into(), "1".into()]]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "name       v");
        assert_eq!(lines[2], "long name  1");
    }
}
