//! Bearer-token authentication. Tokens are configured as BLAKE3 hashes; a presented token is
//! hashed and compared with every configured hash in constant time.

use std::sync::Mutex;

use axum::http::{HeaderMap, StatusCode, header};
use service_kit::http::rate::Bucket;

use crate::config::AuthConfig;
use crate::error::ApiError;
use crate::metrics as m;

#[derive(Debug)]
struct Token {
    name: String,
    hash: blake3::Hash,
    all_streams: bool,
    streams: Vec<String>,
    /// `max_bytes_per_sec`, when set.
    limit: Option<Mutex<Bucket>>,
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
                Ok(_) if t.max_bytes_per_sec == Some(0) => errors.push(format!(
                    "auth.tokens '{}': max_bytes_per_sec must be more than 0 (leave it out for no limit)",
                    t.name
                )),
                Ok(hash) => tokens.push(Token {
                    name: t.name.clone(),
                    hash,
                    all_streams: t.streams.iter().any(|s| s == "*"),
                    streams: t.streams.clone(),
                    limit: t.max_bytes_per_sec.map(|rate| Mutex::new(Bucket::new(rate))),
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
        for t in tokens.iter().filter(|t| t.limit.is_some()) {
            metrics::counter!(m::RATE_LIMITED, "token" => t.name.clone()).increment(0);
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

    /// 429 with `Retry-After` when the caller's token is over its rate limit: it sent more than
    /// `max_bytes_per_sec` allows and has not waited the debt off yet.
    pub fn admit(&self, who: Principal<'_>) -> Result<(), ApiError> {
        let Some(limit) = self.limit(who) else {
            return Ok(());
        };
        let wait = limit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .debt_wait();
        if wait.is_zero() {
            return Ok(());
        }
        let Principal::Token { name, .. } = who else {
            unreachable!("only tokens have limits")
        };
        metrics::counter!(m::RATE_LIMITED, "token" => name.to_owned()).increment(1);
        Err(ApiError {
            retry_after_secs: Some(wait.as_secs_f64().ceil().max(1.0) as u64),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!("token '{name}' is over its max_bytes_per_sec; retry later"),
            )
        })
    }

    /// Counts `bytes` (a body as sent) against the caller's rate limit.
    pub fn charge(&self, who: Principal<'_>, bytes: usize) {
        if let Some(limit) = self.limit(who) {
            limit
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(bytes as u64);
        }
    }

    fn limit(&self, who: Principal<'_>) -> Option<&Mutex<Bucket>> {
        match who {
            Principal::Anonymous => None,
            Principal::Token { index, .. } => self.tokens[index].limit.as_ref(),
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
