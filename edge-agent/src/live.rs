//! What the running agent does, per stream, as it happens: its pipeline's and delivery's
//! counters since the start, the state of its link to the receiver and the last error a
//! delivery attempt met. `/status` serves it next to what waits on disk, and the status page
//! (`/`) shows it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;

use crate::batch::now_ms;
use crate::stats::{DeliveryStats, PipelineStats};

/// The running streams' live state.
#[derive(Debug, Default)]
pub struct Live {
    started_ms: u64,
    streams: Mutex<BTreeMap<String, LiveStream>>,
}

/// The state of a stream's link to the receiver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkState {
    /// Nothing sent yet.
    #[default]
    Idle,
    /// The last attempt was acknowledged.
    Up,
    /// The last attempt failed: the batch is being retried.
    Retrying,
}

/// The last delivery attempt that failed.
#[derive(Debug, Clone, Serialize)]
pub struct LastError {
    pub at_ms: u64,
    /// The error's kind (connect, timeout, the status code's class …), as the
    /// `edge_agent_send_errors_total` metric's `reason`.
    pub kind: String,
    pub message: String,
}

impl LastError {
    fn now(kind: &str, message: String) -> Option<LastError> {
        Some(LastError {
            at_ms: now_ms(),
            kind: kind.to_owned(),
            message,
        })
    }
}

/// One stream's live state.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LiveStream {
    /// Since the agent started: records read, invalid, dropped as duplicates and by filters,
    /// batched, and the batches' raw and encoded bytes (and what the filters did, served as
    /// the stream's `reduction`).
    pub pipeline: PipelineStats,
    /// Since the agent started: batches and records delivered and their bytes on the wire and
    /// uncompressed, and what the receiver did with them.
    pub delivery: DeliveryStats,
    pub link: LinkState,
    /// Failed attempts in a row (0 once one succeeds).
    pub failed_attempts: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<LastError>,
    /// When a batch was last acknowledged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_delivered_ms: Option<u64>,
}

impl Live {
    pub fn new() -> Arc<Live> {
        Arc::new(Live {
            started_ms: now_ms(),
            streams: Mutex::default(),
        })
    }

    /// When the agent started (ms since the epoch).
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// A stream's handle, which its pipeline and delivery update.
    pub fn stream(self: &Arc<Live>, name: &str) -> StreamLive {
        self.update(name, |_| {});
        StreamLive {
            live: self.clone(),
            name: name.to_owned(),
        }
    }

    /// Every running stream's state now.
    pub fn snapshot(&self) -> BTreeMap<String, LiveStream> {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn update(&self, name: &str, f: impl FnOnce(&mut LiveStream)) {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        match streams.get_mut(name) {
            Some(stream) => f(stream),
            None => f(streams.entry(name.to_owned()).or_default()),
        }
    }
}

/// One stream's side of [`Live`]. A handle of no agent (`StreamLive::none`) records nothing.
#[derive(Debug, Clone)]
pub struct StreamLive {
    live: Arc<Live>,
    name: String,
}

impl StreamLive {
    /// A handle that is nobody's: for pipelines and deliveries run outside an agent.
    pub fn none() -> StreamLive {
        StreamLive {
            live: Arc::new(Live::default()),
            name: String::new(),
        }
    }

    /// The pipeline's counters now.
    pub fn pipeline(&self, s: &PipelineStats) {
        self.live.update(&self.name, |l| l.pipeline.clone_from(s));
    }

    /// The delivery's counters after a batch went (acknowledged, or refused and kept aside).
    pub fn delivered(&self, s: &DeliveryStats) {
        self.live.update(&self.name, |l| l.delivery.clone_from(s));
    }

    /// An attempt reached the receiver and had an answer.
    pub fn attempt_answered(&self) {
        self.live.update(&self.name, |l| {
            l.link = LinkState::Up;
            l.failed_attempts = 0;
            l.last_delivered_ms = Some(now_ms());
        });
    }

    /// The receiver refused a batch for good (it is kept aside): it answered, so the link is
    /// up, and the refusal is the last error.
    pub fn batch_refused(&self, status: u16, answer: &str) {
        self.live.update(&self.name, |l| {
            l.link = LinkState::Up;
            l.failed_attempts = 0;
            let answer: String = answer.chars().take(300).collect();
            l.last_error = LastError::now("refused", format!("{status}: {answer}"));
        });
    }

    /// An attempt failed and is retried.
    pub fn attempt_failed(&self, kind: &str, message: &str) {
        self.live.update(&self.name, |l| {
            l.link = LinkState::Retrying;
            l.failed_attempts += 1;
            l.last_error = LastError::now(kind, message.to_owned());
        });
    }
}
