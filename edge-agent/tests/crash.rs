//! The agent process killed with SIGKILL at random points while it reads, spools and delivers to
//! a gateway that fails, times out and answers 429, and while MQTT messages are in flight to it:
//! nothing is lost, nothing lands twice.

mod support;

use std::time::{Duration, Instant};

use rand::Rng;
use support::{
    Faults, Stub, assert_exactly_once, config, readings, service_env, sigkill, spawn_agent,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_points_loses_nothing_and_lands_nothing_twice() {
    let stub = Stub::start(Faults {
        unavailable: 10,
        too_many: 3,
        slow: 4,
        slow_for: Duration::from_millis(1500),
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    // 60,000 distinct readings and 12,000 re-sent ones.
    let (lines, expected) = readings(60_000, 40, 5, 1);
    let input = dir.path().join("readings.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        config(
            &dir.path().join("state"),
            &stub.url(),
            "[batch]\nmax_records = 400\nmax_age_ms = 100\n",
            &format!(
                "[[sources]]\ntype = \"file\"\npath = {input:?}\nstream = \"sensor_readings\"\n"
            ),
        ),
    )
    .unwrap();
    let mut rng = rand::rng();
    let mut kills = 0;
    let mut runs = 0;
    loop {
        runs += 1;
        let mut child = spawn_agent(&cfg, dir.path(), runs);
        let deadline = Instant::now() + Duration::from_millis(rng.random_range(300..2500));
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if kills < 6 && Instant::now() > deadline {
                break None;
            }
            assert!(runs < 40, "the agent never finished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match status {
            Some(status) => {
                let log =
                    std::fs::read_to_string(dir.path().join(format!("agent-{runs}.log"))).unwrap();
                assert!(status.success(), "agent failed: {status}\n{log}");
                break;
            }
            None => {
                sigkill(child);
                kills += 1;
            }
        }
    }
    assert!(
        kills >= 3,
        "only {kills} kills: the run was too short to test anything"
    );
    let recorded = stub.recorded.lock().unwrap();
    eprintln!(
        "{kills} kills over {runs} runs; {} requests, {} replayed by Idempotency-Key",
        recorded.requests, recorded.replays
    );
    drop(recorded);
    assert_exactly_once(&stub.landed(), &expected);
}

/// Publishes `messages` with QoS 1, about 200 a second, and returns once the broker acknowledged
/// every one.
async fn publish_paced(broker: String, topic: &'static str, messages: Vec<String>) {
    let (host, port) = broker.rsplit_once(':').unwrap();
    let id = format!("pub-{}", rand::random::<u32>());
    let mut options = rumqttc::MqttOptions::new(id, host, port.parse().unwrap());
    options.set_keep_alive(Duration::from_secs(5));
    let (client, mut events) = rumqttc::AsyncClient::new(options, 64);
    let n = messages.len();
    let sender = tokio::spawn(async move {
        for m in messages {
            client
                .publish(topic, rumqttc::QoS::AtLeastOnce, false, m)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        client
    });
    let mut acked = 0;
    while acked < n {
        if let rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)) = events.poll().await.unwrap() {
            acked += 1;
        }
    }
    let _ = sender.await;
}

/// QoS 1 messages in flight when the agent dies are sent again by the broker when it is back, and
/// those published while it is down wait in its persistent session: every reading lands once,
/// because a message is acknowledged only once its readings are in the spool and the dedupe
/// window (rebuilt from its log and the spool at start) drops what comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_mqtt_messages_in_flight_loses_nothing_and_lands_nothing_twice() {
    const TOPIC: &str = "plant/crash/readings";
    let broker = service_env("EDGE_INGEST_MQTT");
    let stub = Stub::start(Faults {
        unavailable: 10,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let client_id = format!("agent-crash-{}", rand::random::<u32>());
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        config(
            &dir.path().join("state"),
            &stub.url(),
            "[batch]\nmax_records = 100\nmax_age_ms = 100\n",
            &format!(
                "[[sources]]\ntype = \"mqtt\"\nurl = \"mqtt://{broker}\"\ntopics = [\"{TOPIC}\"]\n\
                 stream = \"sensor_readings\"\nclient_id = \"{client_id}\"\nqos = 1\n"
            ),
        ),
    )
    .unwrap();
    // 3,000 distinct readings and 300 re-sent ones, two lines a message: about 8 s of publishing.
    let (lines, expected) = readings(3_000, 30, 10, 7);
    let messages: Vec<String> = lines.chunks(2).map(|c| c.join("\n")).collect();
    let mut runs = 1;
    let mut child = spawn_agent(&cfg, dir.path(), runs);
    // The persistent session must exist before the run publishes to it: the first message again
    // until something lands (the window drops the copies).
    let deadline = Instant::now() + Duration::from_secs(20);
    while stub.landed_total() == 0 {
        assert!(
            Instant::now() < deadline,
            "the agent never received anything"
        );
        publish_paced(broker.clone(), TOPIC, messages[..1].to_vec()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let publisher = tokio::spawn(publish_paced(broker.clone(), TOPIC, messages[1..].to_vec()));
    let mut rng = rand::rng();
    let mut kills = 0;
    while !publisher.is_finished() {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
        sigkill(child);
        kills += 1;
        // Down for up to 1.2 s: at 200 messages a second, well within mosquitto's queue of 1,000
        // messages per offline client.
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..1200))).await;
        runs += 1;
        child = spawn_agent(&cfg, dir.path(), runs);
    }
    publisher.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while stub.landed_total() < expected.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Whatever would land twice has had time to.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    sigkill(child);
    assert!(
        kills >= 3,
        "only {kills} kills: the run was too short to test anything"
    );
    let recorded = stub.recorded.lock().unwrap();
    eprintln!(
        "{kills} kills over {runs} runs; {} requests, {} replayed by Idempotency-Key",
        recorded.requests, recorded.replays
    );
    drop(recorded);
    assert_exactly_once(&stub.landed(), &expected);
}
