//! The module graph of `userspace/src` has no cycles: every module can be
//! read without first reading the modules that use it. Edges come from
//! `use crate::…` / `use super::…` paths (braces expanded) and inline
//! `crate::a::b` paths.

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
