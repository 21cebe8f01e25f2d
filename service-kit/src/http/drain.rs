//! Request bodies that an error answer leaves unread are read and dropped before the answer goes
//! out.
//!
//! A server that answers early (a bad token, a `Content-Length` over the limit, a body that grows
//! past it) and closes the connection with body bytes still unread makes the kernel reset it.
//! Most HTTP clients write the whole body before they read the answer, so the reset cuts their
//! write ("broken pipe") and they never see the 401 or 413: they retry a request that can never
//! pass, or report a network fault instead of the status. Reading the rest of the body first,
//! up to a bound in bytes and time, lets the answer arrive; past the bound the connection is
//! closed as before.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

/// How much of an unread body is read and dropped after an error answer.
#[derive(Debug, Clone, Copy)]
pub struct Drain {
    /// Bytes read at most; a body with more left is cut.
    pub max_bytes: usize,
    /// Time spent reading at most.
    pub max_time: Duration,
}

/// Middleware (`axum::middleware::from_fn_with_state`): after an answer of 400 or above, reads
/// what the handler left of the request body, within the bound of `drain`.
pub async fn drain_unread(State(drain): State<Drain>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let shared = Shared(Arc::new(Mutex::new(body)));
    let response = next
        .run(Request::from_parts(parts, Body::new(shared.clone())))
        .await;
    if response.status().is_client_error() || response.status().is_server_error() {
        let body = std::mem::take(&mut *shared.0.lock().unwrap_or_else(PoisonError::into_inner));
        drain.read(body).await;
    }
    response
}

impl Drain {
    async fn read(self, mut body: Body) {
        let mut left = self.max_bytes;
        let _ = tokio::time::timeout(self.max_time, async {
            while let Some(Ok(frame)) = body.frame().await {
                let bytes = frame.data_ref().map_or(0, Bytes::len);
                if bytes > left {
                    break;
                }
                left -= bytes;
            }
        })
        .await;
    }
}

/// The request body, read by the handler through one handle and by the middleware through the
/// other once the handler has answered.
#[derive(Clone)]
struct Shared(Arc<Mutex<Body>>);

impl Shared {
    fn with<T>(&self, f: impl FnOnce(&mut Body) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl http_body::Body for Shared {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.with(|body| Pin::new(body).poll_frame(cx))
    }

    fn is_end_stream(&self) -> bool {
        self.with(|body| body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.with(|body| body.size_hint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers every POST with `status` before reading its body, draining `max_bytes` after;
    /// sends it a body of `len` bytes the way most clients do (all of it, then the answer).
    /// Whether the whole body was written, and what was read back.
    async fn post_early_answered(
        status: StatusCode,
        max_bytes: usize,
        len: usize,
    ) -> (bool, String) {
        let router = Router::new()
            .route("/", post(move || async move { status }))
            .layer(axum::middleware::from_fn_with_state(
                Drain {
                    max_bytes,
                    max_time: Duration::from_secs(10),
                },
                drain_unread,
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n"
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        let written = conn.write_all(&vec![b' '; len]).await.is_ok();
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer).await;
        (written, answer)
    }

    /// Without the drain the close resets the connection under the client's write, whatever
    /// the kernel's buffers hold.
    #[tokio::test]
    async fn an_early_answer_reaches_a_client_still_writing_its_body() {
        let (written, answer) =
            post_early_answered(StatusCode::PAYLOAD_TOO_LARGE, 16 << 20, 8 << 20).await;
        assert!(written, "the whole body is taken");
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    }

    /// Past its bound the rest of a body is not read: the connection is closed under the
    /// client's write.
    #[tokio::test]
    async fn a_body_past_the_bound_is_cut() {
        let (written, _) = post_early_answered(StatusCode::UNAUTHORIZED, 64 << 10, 64 << 20).await;
        assert!(!written, "64 MiB went into a connection that reads 64 KiB");
    }

    /// A body the handler read in full is not waited on: the answer goes out at once.
    #[tokio::test]
    async fn a_successful_answer_is_not_held() {
        let (written, answer) = post_early_answered(StatusCode::OK, 0, 1 << 10).await;
        assert!(written);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}
