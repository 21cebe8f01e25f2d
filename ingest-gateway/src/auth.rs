//! Bearer-token authentication. Tokens are configured as BLAKE3 hashes; a presented token is
//! hashed and compared with every configured hash in constant time.

use axum::http::{HeaderMap, header};

use crate::api::ApiError;
use crate::config::AuthConfig;

#[derive(Debug)]
struct Token {
    name: String,
    hash: blake3::Hash,
    all_streams: bool,
    streams: Vec<String>,
}

/// Who made a request.
#[derive(Debug, Clone, Copy)]
pub enum Principal<'a> {
    Anonymous,
    Token { name: &'a str, index: usize },
}

#[derive(Debug)]
pub struct Auth {
    allow_anonymous: bool,
    tokens: Vec<Token>,
}

impl Auth {
    pub fn from_config(config: &AuthConfig) -> anyhow::Result<Auth> {
        let mut tokens = Vec::new();
        let mut errors = Vec::new();
        for t in &config.tokens {
            match blake3::Hash::from_hex(t.blake3.trim()) {
                Ok(hash) => tokens.push(Token {
                    name: t.name.clone(),
                    hash,
                    all_streams: t.streams.iter().any(|s| s == "*"),
                    streams: t.streams.clone(),
                }),
                Err(_) => errors.push(format!(
                    "auth.tokens '{}': blake3 must be 64 hex digits",
                    t.name
                )),
            }
        }
        if tokens.is_empty() && !config.allow_anonymous && errors.is_empty() {
            errors.push(
                "no auth.tokens configured: add tokens or set auth.allow_anonymous = true".into(),
            );
        }
        if !errors.is_empty() {
            anyhow::bail!("{}", errors.join("; "));
        }
        Ok(Auth {
            allow_anonymous: config.allow_anonymous,
            tokens,
        })
    }

    /// Identifies the caller: 401 for a missing (unless anonymous access is on) or unknown token.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal<'_>, ApiError> {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return if self.allow_anonymous {
                Ok(Principal::Anonymous)
            } else {
                Err(ApiError::unauthorized(
                    "missing Authorization: Bearer token",
                ))
            };
        };
        let presented = value
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim)
            .ok_or_else(|| ApiError::unauthorized("Authorization must be 'Bearer <token>'"))?;
        let hash = blake3::hash(presented.as_bytes());
        // blake3::Hash compares in constant time; visit every token so timing does not tell
        // which one matched.
        let mut found = None;
        for (index, token) in self.tokens.iter().enumerate() {
            if token.hash == hash {
                found = Some(index);
            }
        }
        match found {
            Some(index) => Ok(Principal::Token {
                name: &self.tokens[index].name,
                index,
            }),
            None => Err(ApiError::unauthorized("unknown token")),
        }
    }

    /// 403 when the caller may not write the stream.
    pub fn authorize(&self, who: Principal<'_>, stream: &str) -> Result<(), ApiError> {
        match who {
            Principal::Anonymous => Ok(()),
            Principal::Token { index, name } => {
                let t = &self.tokens[index];
                if t.all_streams || t.streams.iter().any(|s| s == stream) {
                    Ok(())
                } else {
                    Err(ApiError::forbidden(format!(
                        "token '{name}' may not write stream '{stream}'"
                    )))
                }
            }
        }
    }
}
