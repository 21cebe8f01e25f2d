//! Passwords that may come from the config, an environment override or a file (a mounted
//! secret): the Kafka clients' SASL password and the agent's proxy password.

use std::path::Path;

use anyhow::Context as _;

/// The password given inline or in `file`, exactly one of them; a trailing newline (`\n` or
/// `\r\n`) of the file is not part of it. `what` names the setting in errors (for example
/// `kafka.sasl`): `<what>.password` and `<what>.password_file`.
pub fn password(inline: Option<&str>, file: Option<&Path>, what: &str) -> anyhow::Result<String> {
    let password = match (inline, file) {
        (Some(password), None) => password.to_owned(),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("{what}.password_file: cannot read {}", file.display()))?;
            let line = text.strip_suffix('\n').unwrap_or(&text);
            line.strip_suffix('\r').unwrap_or(line).to_owned()
        }
        _ => anyhow::bail!("give one of {what}.password and {what}.password_file"),
    };
    anyhow::ensure!(!password.is_empty(), "the {what} password is empty");
    Ok(password)
}

// The cases of one and of neither place are tested through `kafka_security::apply`.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_files_line_ending_is_dropped_and_errors_name_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p");
        for (text, expected) in [("s3cret\r\n", "s3cret"), ("a b\n\n", "a b\n")] {
            std::fs::write(&file, text).unwrap();
            assert_eq!(password(None, Some(&file), "x").unwrap(), expected);
        }
        let both = password(Some("a"), Some(&file), "gateway.proxy").unwrap_err();
        assert!(
            both.to_string().contains("gateway.proxy.password_file"),
            "{both}"
        );
    }
}
