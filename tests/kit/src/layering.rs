//! Which files of a crate import each other in a circle ([`file_cycles`]).
//!
//! A crate's modules are layered when a file's imports point only to files below it: then a
//! reader can take the files in order, and a change to one never reaches the files it imports.
//! The check reads the sources as text: every path of code (comments and `#[cfg(test)] mod
//! tests` blocks left out) that starts with `crate::`, `super::` or `self::` is an import of the
//! deepest module file that path names. Method calls on types defined in another file are not
//! seen; paths are.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A module path (`["engine", "core"]` for `engine/core.rs`; empty for `lib.rs`).
type Module = Vec<String>;

/// The circles of files that import each other among the `.rs` files below `src` (a crate's
/// source folder), each as its files' paths relative to `src`, sorted. Empty when the files
/// are layered.
pub fn file_cycles(src: &Path) -> std::io::Result<Vec<Vec<String>>> {
    let mut files = BTreeMap::new();
    collect(src, src, &mut files)?;
    let mut graph: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (m, path) in &files {
        let text = code_of(&fs::read_to_string(path)?);
        let deps = graph.entry(m.clone()).or_default();
        for p in paths_in(&text) {
            let Some(target) = resolve(m, &p, &files) else {
                continue;
            };
            if &target != m {
                deps.insert(target);
            }
        }
    }
    let name = |m: &Module| {
        let path = &files[m];
        path.strip_prefix(src).unwrap_or(path).display().to_string()
    };
    Ok(strong_components(&graph)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut v: Vec<String> = c.iter().map(name).collect();
            v.sort();
            v
        })
        .collect())
}

/// Every `.rs` file of the library below `dir`, by module path (a folder's `mod.rs` is the
/// folder's module). Binaries (`main.rs`, `bin/`) are crates of their own and left out.
fn collect(root: &Path, dir: &Path, out: &mut BTreeMap<Module, PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let rel = path.strip_prefix(root).unwrap_or(&path);
        if rel == Path::new("main.rs") || rel == Path::new("bin") {
            continue;
        }
        if path.is_dir() {
            collect(root, &path, out)?;
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let mut m: Module = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(m.last().map(String::as_str), Some("mod" | "lib")) {
            m.pop();
        }
        out.insert(m, path);
    }
    Ok(())
}

/// The code of a file: without its `#[cfg(test)] mod tests` block (to the end of the file, where
/// this crate keeps it) and without comments.
fn code_of(text: &str) -> String {
    let mut end = text.len();
    let mut from = 0;
    while let Some(i) = text[from..].find("#[cfg(test)]") {
        let at = from + i;
        let rest = text[at + "#[cfg(test)]".len()..].trim_start();
        if rest.starts_with("mod tests") {
            end = at;
            break;
        }
        from = at + 1;
    }
    text[..end]
        .lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths that start with `crate`, `super` or `self` in `code`, as their segments; a group
/// (`super::{a, b::{c, D}}`) gives one path per item.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    for head in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(head) {
            let at = from + i;
            from = at + head.len();
            if at > 0 && (is_ident(b[at - 1] as char) || b[at - 1] == b':') {
                continue;
            }
            expand(Vec::new(), &code[at..], &mut out);
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Adds the path at the start of `text` (after the segments `prefix`) to `out`, one per item
/// of a group.
fn expand(prefix: Vec<String>, text: &str, out: &mut Vec<Vec<String>>) {
    let text = text.trim_start();
    let len = text
        .find(|c: char| !(is_ident(c) || c == ':'))
        .unwrap_or(text.len());
    let mut segs = prefix;
    segs.extend(
        text[..len]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
    );
    let rest = &text[len..];
    if !(text[..len].ends_with("::") && rest.starts_with('{')) {
        out.push(segs);
        return;
    }
    // The group's items: split at its top-level commas, up to its closing brace.
    let (mut depth, mut start) = (0usize, 1);
    for (i, c) in rest.char_indices() {
        match c {
            '{' => depth += 1,
            '}' | ',' if depth == 1 => {
                let item = rest[start..i].trim();
                if !item.is_empty() && item != "self" {
                    expand(segs.clone(), item, out);
                } else if item == "self" {
                    out.push(segs.clone());
                }
                if c == '}' {
                    return;
                }
                start = i + 1;
            }
            '}' => depth -= 1,
            _ => {}
        }
    }
}

/// The deepest module file that `path`, written in module `m`, names (`self` is `m` and
/// `super` its parent, whether `m` is a file or a folder's `mod.rs`).
fn resolve(m: &Module, path: &[String], files: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let mut full: Module = m.clone();
    let mut segs = path.iter();
    match segs.next().map(String::as_str) {
        Some("crate") => full.clear(),
        Some("self") => {}
        Some("super") => {
            full.pop()?;
            while segs.as_slice().first().is_some_and(|s| s == "super") {
                segs.next();
                full.pop()?;
            }
        }
        _ => return None,
    }
    full.extend(segs.cloned());
    (0..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|p| files.contains_key(p))
}

/// The strongly connected components of `graph` (Tarjan's algorithm, iterative).
fn strong_components(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    let nodes: Vec<&Module> = graph.keys().collect();
    let at: BTreeMap<&Module, usize> = nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
    let succ: Vec<Vec<usize>> = nodes
        .iter()
        .map(|m| {
            graph[*m]
                .iter()
                .filter_map(|d| at.get(d).copied())
                .collect()
        })
        .collect();
    let n = nodes.len();
    let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on, mut stack, mut out) = (vec![false; n], Vec::new(), Vec::new());
    let mut next = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        // (node, next successor to visit)
        let mut walk = vec![(root, 0)];
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on[root] = true;
        while let Some(&mut (v, ref mut i)) = walk.last_mut() {
            if let Some(&w) = succ[v].get(*i) {
                *i += 1;
                if index[w] == usize::MAX {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on[w] = true;
                    walk.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            walk.pop();
            if let Some(&(u, _)) = walk.last() {
                low[u] = low[u].min(low[v]);
            }
            if low[v] == index[v] {
                let mut comp = Vec::new();
                while let Some(w) = stack.pop() {
                    on[w] = false;
                    comp.push(nodes[w].clone());
                    if w == v {
                        break;
                    }
                }
                out.push(comp);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A folder of source files, removed when dropped.
    struct Crate(PathBuf);

    impl Drop for Crate {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn crate_of(files: &[(&str, &str)]) -> Crate {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvwire-layering-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        for (path, text) in files {
            let p = dir.join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
        Crate(dir)
    }

    #[test]
    fn finds_the_circles_and_only_them() {
        let d = crate_of(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n"),
            ("a/mod.rs", "mod x;\nuse crate::b::B;\npub use self::x::X;\n"),
            // `super` from a/x.rs is `a`, which uses x: a circle.
            ("a/x.rs", "use super::A;\n"),
            ("b.rs", "use self::inner::Y; // use crate::c::C;\n"),
            (
                "c.rs",
                "use crate::a::x::X;\n#[cfg(test)]\nmod tests {\n use crate::c::C; use crate::b::B;\n}\n",
            ),
        ]);
        assert_eq!(
            file_cycles(&d.0).unwrap(),
            vec![vec!["a/mod.rs".to_string(), "a/x.rs".to_string()]]
        );
        // b -> c only in a comment, c -> b only in its tests: no circle there. A chain (a -> b
        // -> c -> a/x) is none either; a/x -> b closes one of three.
        let d = crate_of(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a/mod.rs", "mod x;\nuse crate::b::B;\n"),
            ("a/x.rs", "pub struct X;\n"),
            ("b.rs", "use crate::c::C;\n"),
            ("c.rs", "use crate::a::x::X;\n"),
        ]);
        assert_eq!(file_cycles(&d.0).unwrap().len(), 0);
        let d = crate_of(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a/mod.rs", "mod x;\n"),
            ("a/x.rs", "use crate::b::B;\n"),
            ("b.rs", "use crate::c::C;\n"),
            ("c.rs", "use super::a::x::X;\n"),
        ]);
        assert_eq!(
            file_cycles(&d.0).unwrap(),
            vec![vec![
                "a/x.rs".to_string(),
                "b.rs".to_string(),
                "c.rs".to_string()
            ]]
        );
        // A binary's `crate` is itself: main.rs and bin/ are not files of the library.
        let bin = crate_of(&[
            ("lib.rs", "mod b;\npub struct R;\n"),
            ("main.rs", "mod b;\nuse crate::b::B;\n"),
            ("bin/tool.rs", "use kvwire::R;\n"),
            ("b.rs", "use crate::R;\n"),
        ]);
        let mut files = BTreeMap::new();
        collect(&bin.0, &bin.0, &mut files).unwrap();
        let modules: Vec<&Module> = files.keys().collect();
        assert_eq!(modules, [&Vec::<String>::new(), &vec!["b".to_string()]]);
        assert_eq!(file_cycles(&bin.0).unwrap().len(), 0);
        let grouped = crate_of(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a/mod.rs", "mod x;\n"),
            ("a/x.rs", "use crate::{b::B, c};\n"),
            ("b.rs", "pub struct B;\n"),
            ("c.rs", "use super::{a::{self, x::{X, Y}}, b};\n"),
        ]);
        // a/x -> c (an item of a group) -> a/x (an item of a group in a group).
        assert_eq!(
            file_cycles(&grouped.0).unwrap(),
            vec![vec!["a/x.rs".to_string(), "c.rs".to_string()]]
        );
    }
}
