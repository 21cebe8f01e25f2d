//! Small batches with the stream's zstd dictionary, agent → gateway → Kafka: trained with
//! `edge-agent train-dictionary`'s functions on the stream's own records and installed next to
//! the definitions. A gateway with the dictionary takes the batches as they are; a gateway
//! without it makes the agent resend them without, and nothing is lost either way.

use crate::common;

use edge_agent::dictionary::{install_dictionary, train_dictionary};
use ingest_gateway::GatewayConfig;
use loadtest::demo::{FileAgent, distinct_hashes, file_agent};
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use tokio_util::sync::CancellationToken;

/// Runs an agent over `ndjson` in batches of three records against a new gateway that knows
/// `streams`, and returns the agent's delivery totals.
async fn deliver(
    kafka: &str,
    agent_streams: &schemas::Streams,
    gateway_streams: schemas::Streams,
    ndjson: &[u8],
) -> edge_agent::deliver::DeliveryStats {
    let id = common::unique_id();
    let shutdown = CancellationToken::new();
    let mut gateway = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        ..GatewayConfig::default()
    };
    gateway.auth.allow_anonymous = true;
    gateway.kafka.brokers = kafka.to_owned();
    gateway.kafka.topic_prefix = format!("dict{id}.");
    gateway.kafka.create_topics = true;
    let gateway = ingest_gateway::start(gateway, gateway_streams, shutdown.clone())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let agent = file_agent(&FileAgent {
        dir: dir.path(),
        ndjson,
        gateway: gateway.addr,
        token: None,
        max_records: 3,
        admin_listen: None,
        follow: false,
        more: "",
    })
    .unwrap();
    let stats = edge_agent::run(agent, agent_streams.clone(), shutdown.clone())
        .await
        .unwrap()
        .total();
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
    stats.delivery
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_batches_go_with_the_dictionary_and_without_it_to_a_gateway_that_lacks_it() {
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let plain_streams = schemas::example_streams();
    let def = plain_streams.get("sensor_readings").unwrap();

    // Trained on one day of the fleet, used on readings it never saw.
    let history = to_ndjson(&sensor_readings(&FleetSpec {
        records: 5_000,
        seed: 1,
        ..FleetSpec::default()
    }));
    let (dictionary, trained) = train_dictionary(def, &history, 16 * 1024, 100_000).unwrap();
    assert_eq!(trained.invalid, 0);
    let streams_dir = tempfile::tempdir().unwrap();
    for (name, text) in schemas::EXAMPLE_STREAMS {
        std::fs::write(streams_dir.path().join(format!("{name}.toml")), text).unwrap();
    }
    let installed = install_dictionary(streams_dir.path(), "sensor_readings", &dictionary).unwrap();
    assert!(installed.retired.is_none());
    let streams = service_kit::load_streams_dir(streams_dir.path()).unwrap();
    let current = streams
        .get("sensor_readings")
        .unwrap()
        .dictionaries
        .current();
    assert_eq!(current.map(|d| d.id()), Some(dictionary.id()));

    let records = sensor_readings(&FleetSpec {
        records: 1_000,
        seed: 2,
        ..FleetSpec::default()
    });
    let distinct = distinct_hashes(&streams, &records).unwrap().len() as u64;
    let ndjson = to_ndjson(&records);

    let with = deliver(&kafka, &streams, streams.clone(), &ndjson).await;
    assert_eq!(with.accepted, distinct, "{with:?}");
    assert_eq!(with.rejected_batches, 0, "{with:?}");
    let without = deliver(&kafka, &streams, plain_streams.clone(), &ndjson).await;
    assert_eq!(without.accepted, distinct, "{without:?}");
    assert_eq!(without.rejected_batches, 0, "{without:?}");
    assert_eq!(with.raw_bytes, without.raw_bytes);
    // Three-record batches (a quiet site, batches closed by age): the dictionary saves about a
    // third of the wire bytes (35% when measured; the readings' values are random).
    assert!(
        with.wire_bytes * 4 < without.wire_bytes * 3,
        "with the dictionary {} wire bytes, without {} ({} raw)",
        with.wire_bytes,
        without.wire_bytes,
        with.raw_bytes
    );

    // A new dictionary retires the old one, which still loads for decoding.
    let newer = train_dictionary(def, &ndjson, 8 * 1024, 100_000).unwrap().0;
    let installed = install_dictionary(streams_dir.path(), "sensor_readings", &newer).unwrap();
    assert!(installed.retired.is_some());
    let streams = service_kit::load_streams_dir(streams_dir.path()).unwrap();
    let dictionaries = &streams.get("sensor_readings").unwrap().dictionaries;
    assert_eq!(dictionaries.current().map(|d| d.id()), Some(newer.id()));
    assert!(dictionaries.get(dictionary.id()).is_some());
}
