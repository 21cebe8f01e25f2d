//! Checks of the repository itself: the product speaks of what it does now, never of how it was
//! made, and cites no file outside the repository.

use crate::common;

use std::process::Command;

/// Tracked files' lines that match the extended regular expression `pattern` (`-i`: in any case).
fn tracked_lines_matching(flags: &str, pattern: &str) -> Vec<String> {
    let out = Command::new("git")
        .args(["grep", flags, pattern])
        .current_dir(common::repo_root())
        .output()
        .expect("cannot run git grep");
    // git grep exits 1 when nothing matches, 0 when something does.
    assert!(
        out.status.code().is_some_and(|c| c <= 1),
        "git grep failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// History lives in git log: no tracked file dates a change by a numbered work round. The
/// pattern is put together here so that this file does not match it.
#[test]
fn no_tracked_file_tells_the_work_history() {
    let pattern = format!("{}{}", "session", " [0-9]+");
    let found = tracked_lines_matching("-nIiE", &pattern);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// Nothing cites the design contract that is not part of the repository.
#[test]
fn no_tracked_file_cites_a_file_outside_the_repository() {
    let pattern = ["DES", "IGN\\.md|DES", "IGN's"].concat();
    let found = tracked_lines_matching("-nIE", &pattern);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// Tracked files whose path ends with `suffix`.
fn tracked_files(suffix: &str) -> Vec<std::path::PathBuf> {
    let out = Command::new("git")
        .args(["ls-files"])
        .current_dir(common::repo_root())
        .output()
        .expect("cannot run git ls-files");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|p| p.ends_with(suffix))
        .map(|p| common::repo_root().join(p))
        .collect()
}

/// The layout stays readable: no Rust file over 1,000 lines, and the map of the code
/// (ARCHITECTURE.md) within 20 KiB.
#[test]
fn files_stay_within_their_sizes() {
    let long: Vec<String> = tracked_files(".rs")
        .iter()
        .filter_map(|p| {
            let lines = std::fs::read_to_string(p).ok()?.lines().count();
            (lines > 1_000).then(|| format!("{}: {lines} lines", p.display()))
        })
        .collect();
    assert!(long.is_empty(), "{}", long.join("\n"));
    let map = std::fs::metadata(common::repo_root().join("ARCHITECTURE.md")).unwrap();
    assert!(
        map.len() <= 20 * 1024,
        "ARCHITECTURE.md is {} bytes",
        map.len()
    );
}

/// The modules of a crate's `src/` (tests left out), by path (`table::rest`), with the modules
/// each names in its code (`crate::x`, `super::x`; comments left out).
fn module_graph(
    src: &std::path::Path,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut files = BTreeMap::new();
    for path in tracked_files(".rs") {
        let Ok(rel) = path.strip_prefix(src) else {
            continue;
        };
        let mut parts: Vec<String> = rel
            .with_extension("")
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        if parts.iter().any(|p| p == "tests") {
            continue;
        }
        if matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            parts.pop();
        }
        files.insert(parts.join("::"), path);
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let code: String = text
            .split("#[cfg(test)]\nmod tests {")
            .next()
            .unwrap()
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .map(|l| l.split(" //").next().unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
        let mut names = BTreeSet::new();
        for (prefix, base) in [("crate::", String::new()), ("super::", parent.to_owned())] {
            for (at, _) in code.match_indices(prefix) {
                let path: Vec<&str> = code[at + prefix.len()..]
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                    .next()
                    .unwrap()
                    .split("::")
                    .collect();
                // The longest prefix of the path that is a module.
                for k in (1..=path.len()).rev() {
                    let name = path[..k].join("::");
                    let name = if base.is_empty() {
                        name
                    } else {
                        format!("{base}::{name}")
                    };
                    if files.contains_key(&name) {
                        let related = name.starts_with(&format!("{module}::"))
                            || module.starts_with(&format!("{name}::"));
                        if name != *module && !related {
                            names.insert(name);
                        }
                        break;
                    }
                }
            }
        }
        graph.insert(module.clone(), names);
    }
    graph
}

/// No two files of a crate import each other, directly or through others: each crate's modules
/// form layers.
#[test]
fn no_import_circle_between_the_files_of_a_crate() {
    let mut circles = Vec::new();
    for krate in [
        "schemas",
        "service-kit",
        "edge-agent",
        "ingest-gateway",
        "sink",
        "loadtest",
    ] {
        let graph = module_graph(&common::repo_root().join(krate).join("src"));
        assert!(graph.len() > 3, "{krate}: {graph:?}");
        // A module is in a circle when it reaches itself.
        for start in graph.keys() {
            let mut seen = std::collections::BTreeSet::new();
            let mut todo: Vec<&String> = graph[start].iter().collect();
            while let Some(next) = todo.pop() {
                if next == start {
                    circles.push(format!("{krate}: {start} imports itself through {seen:?}"));
                    break;
                }
                if seen.insert(next.clone()) {
                    todo.extend(graph.get(next).into_iter().flatten());
                }
            }
        }
    }
    assert!(circles.is_empty(), "{}", circles.join("\n"));
}
