//! Secrets that may come from the config, an environment override or a file (a mounted
//! secret): the Kafka clients' SASL password, the agent's gateway token, proxy password, MQTT
//! password and local port token. A [`Secret`] prints as `<redacted>`, so a config printed for
//! debugging or an error never shows one.

use std::path::Path;

use anyhow::Context as _;

/// A secret value of a config: deserialized from a string, printed as `<redacted>`.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// The value itself, for where it is used (a header, a login).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Secret {
        Secret(value)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// An optional secret given inline or in `file`, at most one of them: `setting` names it in
/// errors (`gateway.token` and `gateway.token_file`). A file's trailing newline (`\n` or
/// `\r\n`) is not part of it; an empty one is refused.
pub fn resolve(
    inline: Option<&Secret>,
    file: Option<&Path>,
    setting: &str,
) -> anyhow::Result<Option<Secret>> {
    let value = match (inline, file) {
        (None, None) => return Ok(None),
        (Some(value), None) => value.0.clone(),
        (None, Some(file)) => read_file(file, &format!("{setting}_file"))?,
        (Some(_), Some(_)) => anyhow::bail!("give {setting} or {setting}_file, not both"),
    };
    anyhow::ensure!(!value.is_empty(), "{setting} is empty");
    Ok(Some(Secret(value)))
}

/// The first line of `file`, its line ending dropped; errors name `setting`.
fn read_file(file: &Path, setting: &str) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("{setting}: cannot read {}", file.display()))?;
    let line = text.strip_suffix('\n').unwrap_or(&text);
    Ok(line.strip_suffix('\r').unwrap_or(line).to_owned())
}

/// The password given inline or in `file`, exactly one of them; a trailing newline (`\n` or
/// `\r\n`) of the file is not part of it. `what` names the setting in errors (for example
/// `kafka.sasl`): `<what>.password` and `<what>.password_file`.
pub fn password(inline: Option<&str>, file: Option<&Path>, what: &str) -> anyhow::Result<String> {
    let password = match (inline, file) {
        (Some(password), None) => password.to_owned(),
        (None, Some(file)) => read_file(file, &format!("{what}.password_file"))?,
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

    #[test]
    fn a_secret_comes_from_one_place_and_never_prints() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "tok-from-file\n").unwrap();
        let inline = Secret::from("tok-inline".to_owned());
        let from_file = resolve(None, Some(&file), "gateway.token")
            .unwrap()
            .unwrap();
        assert_eq!(from_file.expose(), "tok-from-file");
        assert_eq!(
            resolve(Some(&inline), None, "gateway.token").unwrap(),
            Some(inline.clone())
        );
        assert_eq!(resolve(None, None, "gateway.token").unwrap(), None);
        let both = resolve(Some(&inline), Some(&file), "gateway.token").unwrap_err();
        assert!(both.to_string().contains("gateway.token_file"), "{both}");
        assert!(!both.to_string().contains("tok-"), "{both}");
        let missing = resolve(None, Some(&dir.path().join("none")), "x.token").unwrap_err();
        assert!(
            format!("{missing:#}").contains("x.token_file"),
            "{missing:#}"
        );
        std::fs::write(&file, "\n").unwrap();
        assert!(resolve(None, Some(&file), "x.token").is_err(), "empty");
        assert_eq!(
            format!("{inline:?} {:?}", Some(&from_file)),
            "<redacted> Some(<redacted>)"
        );
    }
}
