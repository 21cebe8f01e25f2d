//! Checks of the documentation: every link and include of the docs book, the README and the
//! other top-level documents leads somewhere, every page is in the book's summary, and every
//! config key a binary takes is documented in its shipped config file, which the configuration
//! reference includes.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The Markdown files checked: the book's pages and the documents around the code.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "SECURITY.md",
        "streams/README.md",
    ]
    .iter()
    .map(|f| root.join(f))
    .collect();
    let mut stack = vec![root.join("docs/src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The anchor mdBook (and GitHub) gives a heading: lower case, spaces to dashes, punctuation
/// other than dashes and underscores dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn anchors(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap();
    prose(&text)
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| slug(h.trim_start_matches('#')))
        .collect()
}

/// The targets of the inline links `[text](target)` of `text`, code spans left out.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text).lines() {
        // Code spans may hold brackets and parentheses that are not links.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join("");
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_link_and_include_of_the_docs_leads_somewhere() {
    let root = common::repo_root();
    let mut broken = Vec::new();
    for doc in documents(&root) {
        let text = std::fs::read_to_string(&doc).unwrap();
        let dir = doc.parent().unwrap();
        let name = doc.strip_prefix(&root).unwrap().display().to_string();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let resolved = if file.is_empty() {
                doc.clone()
            } else {
                dir.join(file)
            };
            if !resolved.exists() {
                broken.push(format!("{name}: {target}: no such file"));
            } else if !anchor.is_empty()
                && resolved.extension().is_some_and(|e| e == "md")
                && !anchors(&resolved).contains(anchor)
            {
                broken.push(format!("{name}: {target}: no such heading"));
            }
        }
        for (at, _) in text.match_indices("{{#include ") {
            let rest = &text[at + "{{#include ".len()..];
            let file = rest[..rest.find("}}").unwrap()].trim();
            if !dir.join(file).is_file() {
                broken.push(format!("{name}: include {file}: no such file"));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn every_page_of_the_book_is_in_its_summary() {
    let root = common::repo_root();
    let src = root.join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<PathBuf> = link_targets(&summary)
        .into_iter()
        .map(|t| src.join(t))
        .collect();
    let pages: BTreeSet<PathBuf> = documents(&root)
        .into_iter()
        .filter(|p| p.starts_with(&src) && !p.ends_with("SUMMARY.md"))
        .collect();
    let missing: Vec<_> = pages.difference(&listed).collect();
    assert!(missing.is_empty(), "pages not in SUMMARY.md: {missing:?}");
    let absent: Vec<_> = listed.difference(&pages).collect();
    assert!(
        absent.is_empty(),
        "SUMMARY.md lists missing pages: {absent:?}"
    );
}

/// The names in backquotes after "expected" in a config error: the fields (or variants) that
/// the table (or enum) at the probed place takes.
fn expected_names(error: &str) -> Option<Vec<String>> {
    let at = error.find("expected")?;
    // Names are in backquotes, and figment quotes the list as a whole too
    // ("expected `one of `a`, `b``"): keep the parts that are names.
    let names: Vec<String> = error[at..]
        .lines()
        .next()
        .unwrap_or_default()
        .split('`')
        .filter(|n| {
            !n.is_empty()
                && n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        })
        .map(str::to_owned)
        .collect();
    (!names.is_empty()).then_some(names)
}

/// Every key a config type `T` takes, as dotted paths, found by asking its loader about a key it
/// does not know at every table it has: the error lists the table's fields. Arrays of tables
/// tagged by `type` are asked for their variants, and maps of tables for their values' fields.
fn config_keys<T: serde::de::DeserializeOwned>(dir: &Path) -> BTreeSet<String> {
    const PROBE: &str = "zz_probe";
    let file = dir.join("probe.toml");
    let error = |toml: String| -> String {
        std::fs::write(&file, toml).unwrap();
        match service_kit::load_config::<T>(Some(&file), "NO_SUCH_PREFIX_") {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    };
    let unknown = |e: &str| e.contains(PROBE) && e.contains("unknown field");
    let mut keys = BTreeSet::new();
    // (table header, extra lines, key path)
    let mut todo = vec![(String::new(), String::new(), String::new())];
    while let Some((header, extra, path)) = todo.pop() {
        let e = error(format!("{header}\n{extra}{PROBE} = 1\n"));
        let Some(fields) = unknown(&e).then(|| expected_names(&e)).flatten() else {
            continue;
        };
        for field in fields {
            let key = if path.is_empty() {
                field.clone()
            } else {
                format!("{path}.{field}")
            };
            keys.insert(key.clone());
            let as_table = format!("[{key}]");
            let e = error(format!("{as_table}\n{PROBE} = 1\n"));
            if unknown(&e) {
                todo.push((as_table, String::new(), key));
            } else if e.contains("sequence") {
                let as_array = format!("[[{key}]]");
                let tags = error(format!("{as_array}\ntype = \"{PROBE}\"\n"));
                match expected_names(&tags).filter(|_| tags.contains("variant")) {
                    Some(variants) => {
                        for v in variants {
                            todo.push((as_array.clone(), format!("type = \"{v}\"\n"), key.clone()));
                        }
                    }
                    None => todo.push((as_array, String::new(), key)),
                }
            } else {
                // A map of tables: its values' fields.
                let entry = format!("[{key}.zz_entry]");
                if unknown(&error(format!("{entry}\n{PROBE} = 1\n"))) {
                    todo.push((entry, String::new(), format!("{key}.*")));
                }
            }
        }
    }
    keys
}

/// The TOML examples of the docs book (its ```toml blocks), one after the other.
fn toml_examples(root: &Path) -> String {
    let mut out = String::new();
    let mut pages = vec![root.join("docs/src")];
    while let Some(path) = pages.pop() {
        if path.is_dir() {
            pages.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        } else if path.extension().is_some_and(|e| e == "md") {
            let page = std::fs::read_to_string(&path).unwrap();
            for block in page.split("```toml\n").skip(1) {
                out.push_str(block.split("```").next().unwrap_or(""));
            }
        }
    }
    out
}

/// A key is documented when its name is set (or shown commented out) in the shipped config or a
/// TOML example of the docs book (`examples`), or names a table there.
fn undocumented(keys: &BTreeSet<String>, config: &Path, examples: &str) -> Vec<String> {
    let text = std::fs::read_to_string(config).unwrap() + "\n" + examples;
    // `name =` at the start of a line, commented out or not, or inside an inline table or a
    // comment after a space; or `[… name …]`, a table's header.
    let documented = |name: &str| {
        text.lines().any(|l| {
            let l = l.trim_start_matches(['#', ' ']);
            (l.starts_with('[') && l.contains(name))
                || l.match_indices(name).any(|(at, _)| {
                    let before = l[..at].chars().next_back();
                    before.is_none_or(|c| matches!(c, ' ' | '{' | ','))
                        && l[at + name.len()..].trim_start().starts_with('=')
                })
        })
    };
    keys.iter()
        .filter(|k| !documented(k.rsplit('.').next().unwrap()))
        .cloned()
        .collect()
}

#[test]
fn every_config_key_is_documented() {
    let root = common::repo_root();
    let dir = tempfile::tempdir().unwrap();
    let checks = [
        (
            "edge-agent",
            config_keys::<edge_agent::AgentConfig>(dir.path()),
        ),
        (
            "ingest-gateway",
            config_keys::<ingest_gateway::config::GatewayConfig>(dir.path()),
        ),
        ("sink", config_keys::<sink::config::SinkConfig>(dir.path())),
    ];
    let mut missing = Vec::new();
    let examples = toml_examples(&root);
    for (binary, keys) in &checks {
        assert!(keys.len() > 20, "{binary}: only {keys:?} found");
        let config = root.join(format!("config/{binary}.toml"));
        for key in undocumented(keys, &config, &examples) {
            missing.push(format!("{binary}: {key}"));
        }
    }
    assert!(
        missing.is_empty(),
        "keys neither the shipped configs (and so docs/src/configuration) nor the docs' TOML examples document:\n{}",
        missing.join("\n")
    );
}
