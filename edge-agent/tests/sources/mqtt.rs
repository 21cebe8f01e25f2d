//! The MQTT source against mosquitto: messages land once, those sent while the agent was down
//! too, and topic levels fill records' fields.

use super::*;

const TOPIC: &str = "plant/line1/readings";

/// Publishes NDJSON messages with QoS 1 and waits for every PUBACK.
async fn publish(broker: &str, messages: Vec<String>) {
    support::mqtt_publish(broker, TOPIC, messages, Duration::ZERO).await;
}

/// Publishes `first` until something lands: the agent's subscription exists from then on.
async fn first_lands(broker: &str, stub: &Stub, first: Vec<(String, String)>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while stub.landed_total() == 0 {
        support::mqtt_publish_to(broker, first.clone(), Duration::ZERO).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            Instant::now() < deadline,
            "the agent never received anything"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_messages_land_once_including_those_sent_while_the_agent_was_down() {
    let broker = support::service_env("EDGE_INGEST_MQTT");
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let client_id = format!("agent-{}", rand::random::<u32>());
    let cfg = config(
        &dir.path().join("state"),
        &stub.url(),
        "[batch]\nmax_age_ms = 5000\n",
        &format!(
            "[[sources]]\ntype = \"mqtt\"\nurl = \"mqtt://{broker}\"\ntopics = [\"plant/+/readings\"]\nstream = \"sensor_readings\"\nclient_id = \"{client_id}\"\nqos = 1\n"
        ),
    );
    let (lines, expected) = readings(600, 6, 0, 5);
    // Messages of 1 to 3 records.
    let messages: Vec<String> = lines.chunks(2).map(|c| c.join("\n")).collect();
    let (agent, shutdown) = start(&cfg);
    // The session must exist before anything is published to it.
    let first = messages[..1].iter().map(|m| (TOPIC.to_owned(), m.clone()));
    first_lands(&broker, &stub, first.collect()).await;
    // 150 messages: far more than mosquitto's 20 unacknowledged messages in flight, with a
    // batch age of 5 s. Only closing batches at max_unacked keeps this moving.
    let started = Instant::now();
    publish(&broker, messages[1..150].to_vec()).await;
    wait_landed(&stub, 300).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "stalled on unacknowledged messages"
    );
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    // Published while the agent is away: the broker keeps them in the persistent session.
    publish(&broker, messages[150..].to_vec()).await;
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, 600).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

/// `topic_fields` fills fields from the topic's levels: readings published with their device and
/// sensor only in the topic land with the same content hashes as the complete readings. A
/// payload's own value wins over its topic's, and a topic the pattern does not match passes its
/// payload unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_topic_levels_fill_the_records_fields() {
    let broker = support::service_env("EDGE_INGEST_MQTT");
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let site = format!("site-{}", rand::random::<u32>());
    let cfg = config(
        &dir.path().join("state"),
        &stub.url(),
        "[batch]\nmax_age_ms = 200\n",
        &format!(
            "[[sources]]\ntype = \"mqtt\"\nurl = \"mqtt://{broker}\"\n\
             topics = [\"{site}/+/+\", \"{site}/legacy\"]\nstream = \"sensor_readings\"\n\
             client_id = \"agent-{site}\"\nqos = 1\n\
             topic_fields = \"{site}/{{device_id}}/{{sensor}}\"\n"
        ),
    );
    let (lines, expected) = readings(120, 4, 0, 43);
    let mut messages = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let mut record: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(line).unwrap();
        let device = record["device_id"].as_str().unwrap().to_owned();
        let sensor = record["sensor"].as_str().unwrap().to_owned();
        let (topic, payload) = match i % 10 {
            // Complete readings on a topic the pattern does not match.
            0 => (format!("{site}/legacy"), line.clone()),
            // The payload names its device; the topic says another.
            1 => (format!("{site}/elsewhere/{sensor}"), line.clone()),
            _ => {
                record.remove("device_id");
                record.remove("sensor");
                let payload = serde_json::to_string(&record).unwrap();
                (format!("{site}/{device}/{sensor}"), payload)
            }
        };
        messages.push((topic, payload));
    }
    let (agent, shutdown) = start(&cfg);
    // The session must exist before anything is published to it.
    first_lands(&broker, &stub, messages[..1].to_vec()).await;
    support::mqtt_publish_to(&broker, messages[1..].to_vec(), Duration::ZERO).await;
    wait_landed(&stub, expected.len()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}
