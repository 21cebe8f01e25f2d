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
