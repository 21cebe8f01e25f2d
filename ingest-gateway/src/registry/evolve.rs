//! A registration that adds fields to its stream (`registry.add_fields`): the new fields go at
//! the end of the stream's definition file in `streams_dir`, nullable, and its `version` is
//! raised. The file is replaced (written aside, then renamed) only when the result is a
//! compatible change of the definition in force ([`schemas::StreamDef::change_to`]); the gateway
//! then takes it, and sinks and agents reading the same directory take it as they take any
//! compatible change: when a record needs it.

use std::path::Path;
use std::sync::Arc;

use axum::http::StatusCode;
use schemas::{Change, FieldDef, StreamDef};

use super::RegistryError;
use crate::api::AppState;

fn failed(reason: String) -> RegistryError {
    RegistryError(StatusCode::INTERNAL_SERVER_ERROR, 50001, reason)
}

/// Adds `fields` to the definition of `def`'s stream for a registration under `subject`;
/// the definition in force after it.
pub(super) async fn add_fields(
    state: &Arc<AppState>,
    def: &Arc<StreamDef>,
    fields: &[FieldDef],
    subject: &str,
) -> Result<Arc<StreamDef>, RegistryError> {
    let _one_at_a_time = state.registry.evolving.lock().await;
    // Another registration may have added them meanwhile.
    let current = state.stream(&def.name).unwrap_or_else(|| def.clone());
    let missing: Vec<&FieldDef> = fields
        .iter()
        .filter(|f| current.field_index(&f.name).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(current);
    }
    let dir = state
        .streams_dir()
        .ok_or_else(|| failed("the gateway follows no streams_dir".into()))?;
    let path = dir.join(format!("{}.toml", def.name));
    let text = tokio::fs::read_to_string(&path)
        .await
        .map_err(|e| failed(format!("cannot read {}: {e}", path.display())))?;
    let text = with_fields(&text, &missing, subject).map_err(failed)?;
    let new = StreamDef::from_toml(&text).map_err(|e| failed(e.to_string()))?;
    if let Change::Incompatible(reason) = current.change_to(&new) {
        return Err(RegistryError(
            StatusCode::CONFLICT,
            409,
            format!(
                "adding the fields to stream '{}' is not a compatible change: {reason}",
                def.name
            ),
        ));
    }
    let (file, written) = (path.clone(), text.clone());
    tokio::task::spawn_blocking(move || replace(&file, &written))
        .await
        .map_err(|e| failed(e.to_string()))?
        .map_err(|e| failed(format!("cannot write {}: {e}", path.display())))?;
    let names: Vec<&str> = missing.iter().map(|f| f.name.as_str()).collect();
    tracing::info!(stream = %def.name, subject, fields = ?names, version = new.version, "fields added to the stream's definition by a registration");
    state
        .newer_definition(&current)
        .await
        .ok_or_else(|| failed(format!("{} was written but not taken", path.display())))
}

/// The definition text with `fields` appended (nullable, documented as added for `subject`) and
/// its top-level `version` raised by one.
fn with_fields(text: &str, fields: &[&FieldDef], subject: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len() + 128 * fields.len());
    let mut raised = false;
    let mut top = true;
    for line in text.lines() {
        let trimmed = line.trim_start();
        top &= !trimmed.starts_with('[');
        let version = trimmed
            .strip_prefix("version")
            .and_then(|v| v.trim_start().strip_prefix('='))
            .and_then(|v| v.split('#').next())
            .and_then(|v| v.trim().parse::<u32>().ok());
        match version {
            Some(v) if top && !raised => {
                out.push_str(&format!("version = {}", v + 1));
                raised = true;
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    if !raised {
        return Err("the definition has no top-level version line to raise".into());
    }
    for field in fields {
        let doc = if field.doc.is_empty() {
            format!("Added by a schema registered under {subject}")
        } else {
            field.doc.clone()
        };
        out.push_str(&format!(
            "\n[[fields]]\nname = \"{}\"\ntype = \"{}\"\ndoc = {}\n",
            field.name,
            field.ty,
            // A JSON string is a TOML basic string: the same escapes.
            serde_json::Value::String(doc)
        ));
    }
    Ok(out)
}

/// Replaces the file at `path` with `text`: written next to it, synced, then renamed over it.
fn replace(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("toml.registry-tmp");
    {
        use std::io::Write as _;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_appended_and_the_version_raised() {
        let text = "# a stream\nname = \"s\"\nversion = 3 # third\n\n[[fields]]\nname = \"version\"\ntype = \"string\"\n";
        let field = FieldDef {
            name: "humidity".into(),
            ty: schemas::FieldType::Float64,
            required: false,
            doc: "Relative \"humidity\"".into(),
        };
        let out = with_fields(text, &[&field], "ingest.s-value").unwrap();
        assert!(out.contains("\nversion = 4\n"), "{out}");
        assert!(
            out.contains("name = \"version\"\ntype = \"string\""),
            "{out}"
        );
        assert!(
            out.ends_with("[[fields]]\nname = \"humidity\"\ntype = \"float64\"\ndoc = \"Relative \\\"humidity\\\"\"\n"),
            "{out}"
        );
        assert!(with_fields("name = \"s\"\n", &[&field], "x").is_err());
    }
}
