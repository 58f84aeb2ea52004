//! The product's sources stay readable in one sitting: no file over 600 lines
//! and no function over 120. Product sources are the crates that ship
//! (`userspace`, `cni`, `common`, `ebpf`); tests and tools are not held to it.

use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 120;
const PRODUCT: [&str; 4] = ["userspace/src", "cni/src", "common/src", "ebpf/src"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn product_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in PRODUCT {
        rust_files(&root().join(dir), &mut files);
    }
    files.sort();
    files
}

/// The source with comments, string and char literals blanked (newlines
/// kept), so that only code braces are left to count.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        out.extend(s.iter().map(|&c| if c == b'\n' { '\n' } else { ' ' }))
    };
    while i < b.len() {
        let rest = &b[i..];
        let end = if rest.starts_with(b"//") {
            rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len())
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            let mut j = 0;
            loop {
                if rest[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break j;
                    }
                } else {
                    j += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(rest) {
            let close: Vec<u8> = std::iter::once(b'"').chain(vec![b'#'; hashes]).collect();
            let open = hashes + 2 + usize::from(rest[0] == b'b');
            open + find(&rest[open..], &close).unwrap() + close.len()
        } else if rest[0] == b'"' {
            let mut j = 1;
            while rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            j + 1
        } else if rest[0] == b'\'' && char_literal_len(rest).is_some() {
            char_literal_len(rest).unwrap()
        } else {
            out.push(rest[0] as char);
            i += 1;
            continue;
        };
        blank(&mut out, &rest[..end]);
        i += end;
    }
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `r"`, `r#"`, `br##"` …: the number of hashes.
fn raw_string_start(s: &[u8]) -> Option<usize> {
    let s = s.strip_prefix(b"b").unwrap_or(s);
    let s = s.strip_prefix(b"r")?;
    let hashes = s.iter().take_while(|&&c| c == b'#').count();
    (s.get(hashes) == Some(&b'"')).then_some(hashes)
}

/// `'a'`, `'\n'`, `'\u{1F600}'`, `'{'` (not a lifetime such as `'a`).
fn char_literal_len(s: &[u8]) -> Option<usize> {
    if s.get(1) == Some(&b'\\') {
        let close = s[2..].iter().position(|&c| c == b'\'')?;
        return Some(close + 3);
    }
    let ch = std::str::from_utf8(&s[1..s.len().min(6)])
        .or_else(|e| std::str::from_utf8(&s[1..1 + e.valid_up_to()]))
        .ok()?
        .chars()
        .next()?;
    let n = 1 + ch.len_utf8();
    (s.get(n) == Some(&b'\'')).then_some(n + 1)
}

/// Each `fn` with a body: its name, first line and number of lines.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let b = code.as_bytes();
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (at, _) in code.match_indices("fn ") {
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // The body opens at the first `{` before any `;` (a declaration
        // without a body ends at `;`).
        let Some(open) = code[at..].find(['{', ';']).map(|o| at + o) else {
            continue;
        };
        if b[open] == b';' {
            continue;
        }
        let mut depth = 0;
        let mut close = open;
        for (j, &c) in b[open..].iter().enumerate() {
            match c {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let (first, last) = (line_of(at), line_of(close));
        out.push((name, first, last - first + 1));
    }
    out
}

fn relative(p: &Path) -> String {
    p.strip_prefix(root()).unwrap().display().to_string()
}

#[test]
fn no_product_file_is_over_600_lines() {
    let long: Vec<String> = product_files()
        .iter()
        .filter_map(|p| {
            let n = std::fs::read_to_string(p).unwrap().lines().count();
            (n > MAX_FILE_LINES).then(|| format!("{} ({n} lines)", relative(p)))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn no_product_function_is_over_120_lines() {
    let mut long = Vec::new();
    for p in product_files() {
        let code = code_only(&std::fs::read_to_string(&p).unwrap());
        for (name, line, n) in functions(&code) {
            if n > MAX_FN_LINES {
                long.push(format!("{}:{line} fn {name} ({n} lines)", relative(&p)));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_scanner_counts_what_it_should() {
    let src = "fn a() {\n    let s = \"}\";\n    let c = '{';\n    // }\n}\nfn b<'x>(v: &'x str) -> &'x str { v }\nfn decl();\n";
    let fns = functions(&code_only(src));
    assert_eq!(
        fns,
        vec![("a".to_owned(), 1, 5), ("b".to_owned(), 6, 1)],
        "{}",
        code_only(src)
    );
}
