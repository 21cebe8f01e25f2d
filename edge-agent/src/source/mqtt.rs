//! MQTT subscription source (rumqttc). The agent is a client of the plant's broker, not a broker;
//! over TLS (rustls) with `mqtts://`, see [`crate::tls`].
//!
//! The session is persistent (clean session off), so messages published while the agent is away
//! wait at the broker. With QoS 1 acknowledgements are manual: the PUBACK of a message goes out
//! only after its records are durable in the spool (or dropped on purpose). A message that was
//! spooled but not yet acknowledged when the agent died is delivered again and dropped by dedupe.
//!
//! Brokers stop sending once a client holds `max_inflight_messages` unacknowledged messages
//! (mosquitto: 20). The source closes the open batch when it holds `max_unacked` of them, so a
//! slow trickle of messages is never stuck behind the batch age.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS, TlsConfiguration, Transport};
use tokio_util::sync::CancellationToken;

use super::Feed;
use super::fields::{StaticFields, TopicFields};
use crate::chunk::Chunk;
use crate::tls::TlsFiles;

#[derive(Debug, Clone)]
pub struct MqttSpec {
    pub url: String,
    pub topics: Vec<String>,
    pub client_id: String,
    pub qos: u8,
    pub username: Option<String>,
    pub password: Option<service_kit::config::secret::Secret>,
    pub max_unacked: usize,
    /// Certificates for an `mqtts://` url.
    pub tls: TlsFiles,
    /// Fields filled in from each message's topic.
    pub topic_fields: Option<TopicFields>,
    /// Fields filled into every record (after the topic's).
    pub fields: Option<StaticFields>,
}

/// Host, port and whether `url` asks for TLS: `mqtt://` or `tcp://` (port 1883 by default),
/// `mqtts://` or `ssl://` (8883), or a bare `host:port`.
fn endpoint(url: &str) -> anyhow::Result<(String, u16, bool)> {
    let (rest, tls) = match url.split_once("://") {
        Some(("mqtt" | "tcp", rest)) => (rest, false),
        Some(("mqtts" | "ssl", rest)) => (rest, true),
        Some((scheme, _)) => {
            anyhow::bail!("MQTT url '{url}': scheme '{scheme}' is not mqtt:// or mqtts://")
        }
        None => (url, false),
    };
    let rest = rest.trim_end_matches('/');
    let default_port = if tls { 8883 } else { 1883 };
    match rest.rsplit_once(':') {
        Some((host, port)) => Ok((
            host.to_owned(),
            port.parse()
                .map_err(|_| anyhow::anyhow!("bad MQTT port in '{url}'"))?,
            tls,
        )),
        None => Ok((rest.to_owned(), default_port, tls)),
    }
}

/// The transport `url` and `tls` ask for; an error names what is wrong (for `edge-agent check`
/// as much as for the start).
fn transport(url: &str, tls: &TlsFiles) -> anyhow::Result<(String, u16, Transport)> {
    let (host, port, secure) = endpoint(url)?;
    if !secure {
        anyhow::ensure!(
            tls.is_empty(),
            "MQTT url '{url}': ca_file, client_cert and client_key need an mqtts:// url"
        );
        return Ok((host, port, Transport::Tcp));
    }
    let config = crate::tls::client_config(tls).with_context(|| format!("MQTT url '{url}'"))?;
    Ok((
        host,
        port,
        Transport::tls_with_config(TlsConfiguration::Rustls(Arc::new(config))),
    ))
}

/// Checks an MQTT source's url and certificates.
pub fn check(url: &str, tls: &TlsFiles) -> anyhow::Result<()> {
    transport(url, tls).map(drop)
}

/// Subscribes and feeds every message's records until `shutdown`.
pub async fn run(spec: MqttSpec, feed: Feed, shutdown: CancellationToken) -> anyhow::Result<()> {
    let (host, port, transport) = transport(&spec.url, &spec.tls)?;
    let mut options = MqttOptions::new(&spec.client_id, host, port);
    options
        .set_transport(transport)
        .set_keep_alive(Duration::from_secs(30))
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_max_packet_size(16 << 20, 16 << 20);
    if let (Some(user), Some(pass)) = (&spec.username, &spec.password) {
        options.set_credentials(user, pass.expose());
    }
    let qos = if spec.qos == 0 {
        QoS::AtMostOnce
    } else {
        QoS::AtLeastOnce
    };
    let (client, mut events) = AsyncClient::new(options, 256);
    let unacked = Arc::new(AtomicUsize::new(0));
    let mut failures = 0u32;
    let mut mismatches = Mismatches::default();
    loop {
        let event = tokio::select! {
            e = events.poll() => e,
            _ = shutdown.cancelled() => return Ok(()),
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                failures = 0;
                tracing::info!(url = %spec.url, topics = ?spec.topics, "mqtt connected");
                for topic in &spec.topics {
                    client.subscribe(topic, qos).await?;
                }
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                let data = match &spec.topic_fields {
                    None => publish.payload.to_vec(),
                    Some(fields) => {
                        let filled = fields.fill(&publish.topic, &publish.payload);
                        if !filled.matched || filled.conflicts > 0 {
                            mismatches.note(&publish.topic, &filled);
                        }
                        filled.data
                    }
                };
                let data = match &spec.fields {
                    None => data,
                    Some(fields) => fields.fill(&data),
                };
                let done: Option<crate::chunk::Done> = if publish.qos == QoS::AtMostOnce {
                    None
                } else {
                    unacked.fetch_add(1, Ordering::Relaxed);
                    let (client, unacked) = (client.clone(), unacked.clone());
                    Some(Box::new(move |_| {
                        unacked.fetch_sub(1, Ordering::Relaxed);
                        if let Err(e) = client.try_ack(&publish) {
                            tracing::warn!(error = %e, "cannot queue an mqtt acknowledgement; the broker will deliver the message again");
                        }
                    }))
                };
                let mut chunk = Chunk::new(data, done);
                chunk.flush = unacked.load(Ordering::Relaxed) >= spec.max_unacked.max(1);
                if feed.send(chunk).await.is_err() {
                    return Ok(());
                }
            }
            Ok(_) => {}
            Err(e) => {
                failures += 1;
                let wait = service_kit::process::backoff(
                    failures - 1,
                    Duration::from_millis(250),
                    Duration::from_secs(16),
                );
                if failures <= 3 || failures.is_multiple_of(20) {
                    tracing::warn!(url = %spec.url, error = %e, ?wait, "mqtt connection failed; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.cancelled() => return Ok(()),
                }
            }
        }
    }
}

/// Warnings about topics `topic_fields` does not match and payloads that disagree with their
/// topic: the first at once, then at most one a minute with the count since the last.
#[derive(Default)]
struct Mismatches {
    since_warned: u64,
    warned_at: Option<std::time::Instant>,
}

impl Mismatches {
    fn note(&mut self, topic: &str, filled: &super::fields::Filled) {
        self.since_warned += 1;
        if self
            .warned_at
            .is_some_and(|at| at.elapsed() < Duration::from_secs(60))
        {
            return;
        }
        let what = if filled.matched {
            "the payload sets fields of topic_fields to other values; the payload's are kept"
        } else {
            "the topic does not match topic_fields; the payload is taken as it is"
        };
        tracing::warn!(topic, messages = self.since_warned, "{what}");
        self.since_warned = 0;
        self.warned_at = Some(std::time::Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::endpoint;

    #[test]
    fn urls_name_the_transport_and_its_default_port() {
        let parsed = |url: &str| endpoint(url).unwrap();
        assert_eq!(parsed("mqtt://broker"), ("broker".into(), 1883, false));
        assert_eq!(parsed("tcp://broker:1884/"), ("broker".into(), 1884, false));
        assert_eq!(parsed("broker:1885"), ("broker".into(), 1885, false));
        assert_eq!(parsed("mqtts://broker"), ("broker".into(), 8883, true));
        assert_eq!(parsed("ssl://broker:8884"), ("broker".into(), 8884, true));
        assert!(endpoint("mqtt://broker:port").is_err());
        assert!(endpoint("ws://broker").is_err());
    }
}
