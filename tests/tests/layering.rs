//! The module graph of `userspace/src` has no cycles: every module can be
//! read without first reading the modules that use it. Edges come from
//! `use crate::…` / `use super::…` paths (braces expanded) and inline
//! `crate::a::b` paths. And no module imports its ancestors' own items: what
//! siblings share lives in a sibling module, not in a `mod.rs` above them.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

fn modules(dir: &Path, prefix: &[String], out: &mut BTreeMap<Vec<String>, String>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "bin" {
                let mut pre = prefix.to_vec();
                pre.push(name);
                modules(&p, &pre, out);
            }
        } else if let Some(stem) = name.strip_suffix(".rs") {
            let mut m = prefix.to_vec();
            if !matches!(stem, "mod" | "lib" | "main") {
                m.push(stem.to_owned());
            }
            out.insert(m, std::fs::read_to_string(&p).unwrap());
        }
    }
}

/// `a::{b, c::{d}}` → `a::b`, `a::c::d`.
fn expand(path: &str) -> Vec<String> {
    let Some(open) = path.find('{') else {
        return vec![path.to_owned()];
    };
    let (pre, inner) = (&path[..open], &path[open + 1..path.len() - 1]);
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for ch in inner.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    parts.push(cur);
    parts
        .iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| expand(&format!("{pre}{p}")))
        .collect()
}

/// The paths a file names: `use` items (braces expanded) and inline paths.
fn paths(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for item in src.split("use ").skip(1) {
        let Some(end) = item.find(';') else { continue };
        let p: String = item[..end].chars().filter(|c| !c.is_whitespace()).collect();
        if p.starts_with("crate::") || p.starts_with("super::") {
            out.extend(expand(&p));
        }
    }
    for (i, _) in src.match_indices("crate::") {
        let rest = &src[i..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        out.push(rest[..end].to_owned());
    }
    out
}

#[test]
fn userspace_modules_have_no_import_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../userspace/src");
    let mut mods = BTreeMap::new();
    modules(&root, &[], &mut mods);
    let names: BTreeSet<Vec<String>> = mods.keys().cloned().collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, src) in &mods {
        for p in paths(src) {
            let mut parts = p.split("::").map(str::to_owned);
            let mut full: Vec<String> = match parts.next().as_deref() {
                Some("crate") => Vec::new(),
                Some("super") => m[..m.len().saturating_sub(1)].to_vec(),
                _ => continue,
            };
            full.extend(parts.filter(|s| !s.is_empty() && s != "self"));
            // The longest prefix that is a module; a module's own parent
            // (its `mod.rs`) does not count as a dependency.
            let target = (1..=full.len())
                .rev()
                .map(|i| full[..i].to_vec())
                .find(|c| names.contains(c));
            if let Some(t) = target {
                if t != *m && !m.starts_with(&t) {
                    edges.entry(m.clone()).or_default().insert(t);
                }
            }
        }
    }
    let reaches = |from: &Vec<String>, to: &Vec<String>| {
        let (mut stack, mut seen) = (vec![from.clone()], BTreeSet::new());
        while let Some(n) = stack.pop() {
            if n == *to {
                return true;
            }
            if seen.insert(n.clone()) {
                stack.extend(edges.get(&n).into_iter().flatten().cloned());
            }
        }
        false
    };
    let cycles: Vec<String> = edges
        .iter()
        .flat_map(|(a, bs)| bs.iter().map(move |b| (a, b)))
        .filter(|(a, b)| reaches(b, a))
        .map(|(a, b)| format!("{} → {}", a.join("::"), b.join("::")))
        .collect();
    assert!(
        edges.len() > 10,
        "the parser found almost no imports: {edges:?}"
    );
    assert!(cycles.is_empty(), "import cycles: {cycles:#?}");
}

/// `src` without its `#[cfg(test)] mod <name> { … }` blocks: a module's tests
/// may `use super::*`.
fn strip_test_modules(src: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let (mut out, mut from) = (String::new(), 0);
    for (at, _) in src.match_indices(ATTR) {
        if at < from {
            continue; // inside a test module already dropped
        }
        let Some(open) = test_module_brace(&src[at + ATTR.len()..]) else {
            continue;
        };
        let open = at + ATTR.len() + open;
        let close = matching_brace(src, open)
            .unwrap_or_else(|| panic!("no closing brace for the test module at byte {open}"));
        out.push_str(&src[from..at]);
        from = close + 1;
    }
    out.push_str(&src[from..]);
    out
}

/// Where the `{` of `[pub[(…)]] mod <name> {` at the start of `item` is.
fn test_module_brace(item: &str) -> Option<usize> {
    let mut rest = item.trim_start();
    if let Some(vis) = rest.strip_prefix("pub") {
        rest = vis.trim_start();
        if rest.starts_with('(') {
            rest = rest[rest.find(')')? + 1..].trim_start();
        }
    }
    let name = rest.strip_prefix("mod ")?.trim_start();
    let brace = name[name.find(|c: char| !(c.is_alphanumeric() || c == '_'))?..].trim_start();
    brace.starts_with('{').then(|| item.len() - brace.len())
}

/// The byte offset of the `}` that closes the `{` at `open`, skipping
/// comments, string and char literals.
fn matching_brace(src: &str, open: usize) -> Option<usize> {
    let b = src.as_bytes();
    let (mut i, mut depth) = (open, 0usize);
    while i < b.len() {
        let from = i;
        match b[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            b'/' if b.get(i + 1) == Some(&b'/') => i += src[i..].find('\n')?,
            b'/' if b.get(i + 1) == Some(&b'*') => i += src[i..].find("*/")? + 1,
            // A raw string: `r"…"`, `r#"…"#`, …
            b'r' if !is_ident(b[i - 1]) && matches!(b.get(i + 1), Some(b'"' | b'#')) => {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) == Some(&b'"') {
                    let end = format!("\"{}", "#".repeat(hashes));
                    i += 2 + hashes;
                    i += src[i..].find(&end)? + end.len() - 1;
                }
            }
            b'"' => {
                i += 1;
                while *b.get(i)? != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
            }
            // A char literal, not a lifetime: `'x'`, `'\n'`, `'\u{7f}'`.
            b'\'' => {
                let mut chars = src[i + 1..].chars();
                match chars.next()? {
                    '\\' => i += 2 + src[i + 2..].find('\'')?,
                    c if chars.next() == Some('\'') => i += 1 + c.len_utf8(),
                    _ => {}
                }
            }
            _ => {}
        }
        i = i.max(from) + 1;
    }
    None
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Inline `super::…` paths, as `paths` finds inline `crate::…` ones (the
/// `super::` inside `super::super::…` is not one more).
fn super_paths(src: &str) -> Vec<String> {
    src.match_indices("super::")
        .filter(|&(i, _)| i == 0 || !matches!(src.as_bytes()[i - 1], c if is_ident(c) || c == b':'))
        .map(|(i, _)| {
            let rest = &src[i..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':' || c == '*'))
                .unwrap_or(rest.len());
            rest[..end].to_owned()
        })
        .collect()
}

/// The full path (from the crate root) that `path`, written in module `m`,
/// names; `None` for a path that starts neither at `crate` nor at `super`.
fn resolve(m: &[String], path: &str) -> Option<Vec<String>> {
    let mut parts = path.split("::").filter(|s| !s.is_empty() && *s != "self");
    let mut full = match parts.next()? {
        "crate" => Vec::new(),
        "super" => m[..m.len().checked_sub(1)?].to_vec(),
        _ => return None,
    };
    for p in parts {
        if p == "super" {
            full.pop()?;
        } else {
            full.push(p.to_owned());
        }
    }
    Some(full)
}

/// A module does not name its ancestors' own items (`use super::*`,
/// `super::item`, `super::super::item`, `crate::<ancestor>::item`): what
/// siblings share lives in a sibling module they name, so a module reads
/// without the files above it. Naming a module through an ancestor
/// (`super::sibling::item`, `crate::agent::custody::Custody` from inside
/// `agent::node`) is fine, and so are the `#[cfg(test)] mod tests` blocks and
/// the `tests.rs` files, which test their parent: its items are theirs. The
/// crate root counts as no one's ancestor: its free functions
/// (`crate::one_line`, `crate::error_line`) are for every module.
#[test]
fn no_module_imports_an_ancestor() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../userspace/src");
    let mut mods = BTreeMap::new();
    modules(&root, &[], &mut mods);
    let names: BTreeSet<Vec<String>> = mods.keys().cloned().collect();
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, src) in &mods {
        // The module whose items count as this file's own.
        let own = if m.last().is_some_and(|l| l == "tests") {
            m.len() - 1
        } else {
            m.len()
        };
        let src = strip_test_modules(src);
        for p in paths(&src).into_iter().chain(super_paths(&src)) {
            let Some(full) = resolve(m, &p) else { continue };
            // An item of an ancestor: named through no module below it.
            let ancestor = (1..own).map(|k| &m[..k]).any(|a| {
                full.len() > a.len() && full.starts_with(a) && !names.contains(&full[..=a.len()])
            });
            if ancestor {
                found.entry(m.join("::")).or_default().insert(p);
            }
        }
    }
    assert!(
        found.is_empty(),
        "modules that import an ancestor's own items (move what they use \
         into a sibling module): {found:#?}"
    );
}
