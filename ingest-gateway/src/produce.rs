//! The Kafka producer: idempotent, acks=all, zstd; a request is answered only after every
//! accepted record was acknowledged.

use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::producer::Producer as _;
use schemas::Streams;
use schemas::wire::topic_name;
use service_kit::kafka::{DeadLetter, DeliveryGroup, GroupProducer, Messages};

use crate::config::KafkaConfig;
use crate::error::ApiError;

pub struct Producer {
    /// Replaced when librdkafka reports a fatal error (e.g. a fenced idempotent producer after
    /// an outage): such an instance can never produce again.
    inner: RwLock<Arc<GroupProducer>>,
    /// Makes the replacements: see [`spawn_factory`].
    factory: mpsc::Sender<mpsc::SyncSender<KafkaResult<GroupProducer>>>,
    topic_prefix: String,
    dead_letter_topic: String,
    max_message_bytes: usize,
}

/// A thread that makes producer instances from `config` on request, for as long as the
/// returned sender lives. It runs at the priority of the thread that calls this (the process's,
/// see [`crate::runtime`]), so the threads librdkafka starts for a replacement producer do
/// not inherit the lower priority of the request worker that found the old one broken.
fn spawn_factory(
    config: ClientConfig,
) -> std::io::Result<mpsc::Sender<mpsc::SyncSender<KafkaResult<GroupProducer>>>> {
    let (tx, rx) = mpsc::channel::<mpsc::SyncSender<KafkaResult<GroupProducer>>>();
    std::thread::Builder::new()
        .name("producer-factory".into())
        .spawn(move || {
            for reply in rx {
                let _ = reply.send(service_kit::kafka::group_producer(&config));
            }
        })?;
    Ok(tx)
}

/// Sets the security settings (`kafka.tls`, `kafka.sasl`) and then the extra properties
/// (`kafka.producer`, which so win) of `config` on `c`.
pub(crate) fn configure(c: &mut ClientConfig, config: &KafkaConfig) -> anyhow::Result<()> {
    service_kit::kafka::security::apply(c, config.tls.as_ref(), config.sasl.as_ref())?;
    for (k, v) in &config.producer {
        c.set(k, v);
    }
    Ok(())
}

impl Producer {
    pub fn new(config: &KafkaConfig, max_inflight_bytes: usize) -> anyhow::Result<Producer> {
        let mut c = service_kit::kafka::producer_config(&config.brokers, config.produce_timeout_ms);
        // The in-flight budget is the limit: librdkafka's queue holds at least as much.
        let kib = (max_inflight_bytes / 1024).clamp(1 << 20, i32::MAX as usize);
        c.set("queue.buffering.max.kbytes", kib.to_string());
        configure(&mut c, config)?;
        let max_message_bytes = service_kit::kafka::max_message_bytes(&c);
        Ok(Producer {
            inner: RwLock::new(Arc::new(service_kit::kafka::group_producer(&c)?)),
            factory: spawn_factory(c).map_err(|e| {
                KafkaError::ClientCreation(format!("cannot start the producer factory: {e}"))
            })?,
            topic_prefix: config.topic_prefix.clone(),
            dead_letter_topic: config.dead_letter_topic.clone(),
            max_message_bytes,
        })
    }

    /// The producer's `message.max.bytes`.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Sends every record and waits for all acknowledgements. Any failure answers 503 with
    /// `Retry-After`: a retry of the same batch is safe, the sink drops re-sent content.
    pub async fn produce(
        &self,
        stream: &str,
        records: Messages,
        dead_letters: Vec<DeadLetter>,
    ) -> Result<(), ApiError> {
        let producer = self.current();
        match self
            .send_all(&producer, stream, records, dead_letters)
            .await
        {
            Ok(()) => Ok(()),
            Err(e) => {
                self.replace_if_broken(&producer, &e);
                // librdkafka waits for a topic it does not know until the produce times out,
                // and says only that: the cluster is asked whether the topic exists.
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageTimedOut) {
                    let topic = topic_name(&self.topic_prefix, stream);
                    if topic_missing(&producer, &topic).await {
                        return Err(kafka_unavailable(&KafkaError::MessageProduction(
                            RDKafkaErrorCode::UnknownTopicOrPartition,
                        )));
                    }
                }
                Err(kafka_unavailable(&e))
            }
        }
    }

    fn current(&self) -> Arc<GroupProducer> {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Creates a new producer instance when `failed` (still the current one) can never produce
    /// again: librdkafka reports a fatal error, or the broker fenced its idempotent producer id
    /// (seen after outages, when the epoch bump is refused).
    fn replace_if_broken(&self, failed: &GroupProducer, error: &KafkaError) {
        let fenced = matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::ProducerFenced
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::UnknownProducerId
                    | RDKafkaErrorCode::OutOfOrderSequenceNumber
            )
        );
        let (code, reason) = match failed.client().fatal_error() {
            Some((code, reason)) => (code, reason),
            None if fenced => (
                error.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail),
                error.to_string(),
            ),
            None => return,
        };
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        if !std::ptr::eq(inner.client().native_ptr(), failed.client().native_ptr()) {
            return; // another request replaced it already
        }
        match self.fresh_instance() {
            Ok(fresh) => {
                tracing::error!(%code, reason, "producer cannot produce any more; replaced it with a new instance");
                *inner = Arc::new(fresh);
                ::metrics::counter!(crate::metrics::PRODUCER_REPLACED).increment(1);
            }
            Err(e) => tracing::error!(error = %e, "cannot replace the failed producer"),
        }
    }

    /// A new producer instance, made by the factory thread.
    pub(crate) fn fresh_instance(&self) -> KafkaResult<GroupProducer> {
        let gone = || KafkaError::ClientCreation("the producer factory has stopped".into());
        let (reply, answer) = mpsc::sync_channel(1);
        self.factory.send(reply).map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())?
    }

    async fn send_all(
        &self,
        producer: &GroupProducer,
        stream: &str,
        records: Messages,
        dead_letters: Vec<DeadLetter>,
    ) -> Result<(), KafkaError> {
        let topic = topic_name(&self.topic_prefix, stream);
        let ingest_ts = service_kit::kafka::ingest_ts_now();
        let mut group = DeliveryGroup::new();
        records.send(producer, &mut group, &topic, &ingest_ts)?;
        // librdkafka copied the values: their buffer need not live while the acks are awaited.
        drop(records);
        for d in &dead_letters {
            d.send(
                producer,
                &mut group,
                &self.dead_letter_topic,
                stream,
                &ingest_ts,
            )?;
        }
        group.settled().await.map(drop)
    }

    /// Whether the cluster answers a metadata request.
    pub async fn is_reachable(&self) -> bool {
        let client = self.current();
        tokio::task::spawn_blocking(move || {
            client
                .client()
                .fetch_metadata(None, Duration::from_secs(3))
                .is_ok()
        })
        .await
        .unwrap_or(false)
    }

    /// Waits for queued records to be delivered, at most `timeout`.
    pub async fn flush(&self, timeout: Duration) {
        let p = self.current();
        let _ = tokio::task::spawn_blocking(move || p.flush(timeout)).await;
    }
}

/// Whether the cluster says that `topic` does not exist (not when it cannot be asked). Asked
/// briefly: in an outage this only delays the answer, which says the cluster is unavailable.
async fn topic_missing(producer: &Arc<GroupProducer>, topic: &str) -> bool {
    let (producer, topic) = (producer.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(Some(&topic), Duration::from_millis(500))
            .is_ok_and(|m| {
                m.topics().iter().any(|t| {
                    t.name() == topic
                        && t.error().map(RDKafkaErrorCode::from)
                            == Some(RDKafkaErrorCode::UnknownTopicOrPartition)
                })
            })
    })
    .await
    .unwrap_or(false)
}

fn kafka_unavailable(e: &KafkaError) -> ApiError {
    if service_kit::kafka::refused_as_too_large(e) {
        tracing::warn!(error = %e, "the broker refused a record batch as too large");
        return ApiError::too_large(format!(
            "Kafka refused the records as too large ({e}): the broker's or the topic's message.max.bytes is below the gateway producer's; a retry will not help until it is raised"
        ));
    }
    // A cluster that refuses the topic is a setting to mend, not an outage: said so, and
    // retried less often; nothing was taken either way.
    let refused = match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => Some(
            "Kafka does not let the gateway write to the stream's topic: its principal needs Write on the topic (an ACL)",
        ),
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => Some(
            "the stream's topic does not exist in Kafka: create it, or let the gateway create it (kafka.create_topics)",
        ),
        _ => None,
    };
    if let Some(what) = refused {
        tracing::error!(error = %e, "produce refused: {what}");
        return ApiError::unavailable(format!("{what} ({e}); nothing was taken"), 30);
    }
    let retry = match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::QueueFull) => 1,
        _ => 5,
    };
    tracing::warn!(error = %e, "produce failed");
    ApiError::unavailable(format!("Kafka did not acknowledge the records: {e}"), retry)
}

/// Creates the topic of every stream that does not exist yet.
pub async fn ensure_topics(config: &KafkaConfig, streams: &Streams) -> anyhow::Result<()> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.brokers);
    configure(&mut c, config)?;
    let admin: AdminClient<DefaultClientContext> = c.create()?;
    let mut names: Vec<String> = streams
        .iter()
        .map(|s| topic_name(&config.topic_prefix, &s.name))
        .collect();
    names.push(config.dead_letter_topic.clone());
    let topics: Vec<NewTopic<'_>> = names
        .iter()
        .map(|n| {
            NewTopic::new(
                n,
                config.topic_partitions,
                TopicReplication::Fixed(config.topic_replication),
            )
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.create_topics(&topics, &opts).await? {
        match result {
            Ok(topic) => tracing::info!(topic, "created topic"),
            Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) => {
                tracing::debug!(topic, "topic exists")
            }
            Err((topic, code)) => anyhow::bail!("cannot create topic {topic}: {code}"),
        }
    }
    Ok(())
}
