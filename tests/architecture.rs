//! The layout the design asks for, checked: the plugin a program links pulls in none of the
//! lab's dependencies, `src/` has no import cycle between its modules, and nothing in `src/`
//! names a concrete pass.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Package names in `cargo tree -p opscope -e normal` with `features` flags.
fn normal_deps(features: &[&str]) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "-p", "opscope", "-e", "normal", "--prefix", "none", "--format", "{p}", "--offline"])
        .args(features)
        .arg("--manifest-path")
        .arg(root().join("Cargo.toml"))
        .output()
        .expect("cargo runs");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect()
}

#[test]
fn the_plugin_links_none_of_the_labs_dependencies() {
    let lab_only = ["tokenizers", "onig", "onig_sys", "plotters", "maud", "clap", "indicatif", "rlx-onnx-import", "rand_distr"];
    for features in [&["--no-default-features"][..], &[][..], &["--features", "parquet"][..]] {
        let deps = normal_deps(features);
        assert!(deps.contains("opscope") && deps.contains("rlx-runtime"), "{features:?}: {deps:?}");
        for name in lab_only {
            assert!(!deps.contains(name), "cargo tree -p opscope {features:?} lists {name}");
        }
        let parquet = deps.contains("parquet") || deps.contains("arrow-array");
        assert_eq!(parquet, features.contains(&"parquet"), "{features:?}: Parquet only behind the feature");
    }
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comments (line and doc comments; opscope has no block comments).
fn code(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Top-level module of a file under `src/` (`src/mine/series.rs` -> `mine`); `None` for lib.rs.
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_string_lossy().to_string();
    let name = first.trim_end_matches(".rs").to_string();
    (name != "lib").then_some(name)
}

#[test]
fn src_modules_import_no_cycle() {
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| top_module(&src, f)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(from) = top_module(&src, f) else { continue };
        let text = code(f);
        for to in modules.iter().filter(|m| **m != from) {
            let uses = ["::", ";", "}", ","].iter().any(|end| text.contains(&format!("crate::{to}{end}")));
            if uses {
                edges.entry(from.clone()).or_default().insert(to.clone());
            }
        }
    }
    // Depth-first search for a cycle; report it as a path.
    fn visit(n: &str, edges: &BTreeMap<String, BTreeSet<String>>, stack: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| s == n) {
            let mut cycle = stack[i..].to_vec();
            cycle.push(n.to_string());
            return Some(cycle);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in &modules {
        if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
            panic!("import cycle between src/ modules: {}\nedges: {edges:#?}", cycle.join(" -> "));
        }
    }
    assert!(edges.values().map(|s| s.len()).sum::<usize>() >= 10, "the scan found the imports: {edges:#?}");
}

#[test]
fn nothing_in_src_names_a_concrete_pass() {
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for f in files.iter().filter(|f| !f.ends_with("lib.rs")) {
        let text = code(f);
        assert!(!text.contains("passes::"), "{} names a pass module", f.display());
    }
}

#[test]
fn statistic_names_are_unique_across_linked_tables() {
    let mut seen = BTreeMap::new();
    for t in opscope::sketch::tables() {
        for s in t.0 {
            if let Some(prev) = seen.insert(s.as_str(), s.def().doc) {
                panic!("statistic '{}' is declared twice: {prev:?} and {:?}", s.as_str(), s.def().doc);
            }
        }
    }
    for name in ["count", "hist", "peak", "load", "cos_row"] {
        assert!(seen.contains_key(name), "{name} linked");
    }
}

#[test]
fn the_readme_column_table_is_the_recording_format() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    for c in opscope::recording::COLUMNS {
        let row = format!("| `{}` | {:?} | {} | {} |", c.name, c.ty, if c.nullable { "yes" } else { "no" }, c.doc);
        assert!(readme.contains(&row), "README lacks the row {row}");
    }
}
