//! Slurm's compact host lists (`gpu[01-04,07],login1`): checked whole, and their first host,
//! which is where rank 0 runs under Slurm's default block distribution.

/// The first host of a Slurm host list, after checking the whole list's syntax: elements
/// separated by commas outside brackets, each a host name with bracket groups of comma-separated
/// numbers or `lo-hi` ranges (zero padding as written: `gpu[01-04]` starts at `gpu01`).
/// `Err` holds what is wrong, as a phrase.
pub(crate) fn first_host(list: &str) -> Result<String, String> {
    if list.trim().is_empty() {
        return Err("it is empty".into());
    }
    let mut first = None;
    for element in split_top_level(list)? {
        let host = first_of_element(element)?;
        first.get_or_insert(host);
    }
    first.ok_or_else(|| "it names no host".into())
}

/// The list's elements: split at commas that are not inside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("a `[` inside brackets at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("a `]` with no `[` before it at byte {i}")),
            ',' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a `[` is never closed".into());
    }
    out.push(&list[start..]);
    Ok(out)
}

/// The first host an element expands to: each bracket group replaced by its first number.
fn first_of_element(element: &str) -> Result<String, String> {
    if element.is_empty() {
        return Err("it has an empty element (two commas, or a comma at an end)".into());
    }
    let mut host = String::new();
    let mut rest = element;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']').map(|c| open + c).ok_or("a `[` is never closed")?;
        host.push_str(first_of_group(&rest[open + 1..close], element)?);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    if let Some(bad) = host.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("host `{element}` holds the character {bad:?}"));
    }
    Ok(host)
}

/// The first number of a bracket group (`01-04,07` gives `01`), after checking every part.
fn first_of_group<'a>(group: &'a str, element: &str) -> Result<&'a str, String> {
    if group.is_empty() {
        return Err(format!("`{element}` has an empty `[]`"));
    }
    let mut first = None;
    for part in group.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(format!("`[{group}]` in `{element}` holds `{part}`, not a number or a range lo-hi"));
        }
        // Compared as numbers, however they are padded (both are digits only, so this parses
        // unless a number is longer than any host list holds).
        let (l, h) = (lo.parse::<u128>(), hi.parse::<u128>());
        if matches!((l, h), (Ok(l), Ok(h)) if l > h) {
            return Err(format!("`[{group}]` in `{element}` holds the range `{part}`, which runs backwards"));
        }
        first.get_or_insert(lo);
    }
    Ok(first.unwrap_or(group))
}
