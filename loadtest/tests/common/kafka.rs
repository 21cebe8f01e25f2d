//! Apache Kafka nodes of a test's own, run by `scripts/kafka.sh` from the jars that
//! `scripts/services.sh install` put in the cache: a cluster of KRaft nodes on loopback (each
//! broker and controller), to kill, stop and restart one by one; a node that advertises another
//! port (a proxy in front of it); listeners with TLS and SASL. The suite's shared broker is
//! `EDGE_INGEST_KAFKA`; these are for tests that take brokers down or configure them.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};

/// What a cluster is started with.
#[derive(Default)]
pub struct KafkaOptions {
    /// Nodes (each a broker and a controller); 3 gives the internal topics and new topics a
    /// replication factor of 3 and `min.insync.replicas = 2`.
    pub nodes: usize,
    /// Server properties of every node, after the suite's (`scripts/kafka/test.properties`).
    pub props: Vec<(String, String)>,
    /// Listeners beside `PLAINTEXT` (which the brokers speak among themselves) and
    /// `CONTROLLER`: a name and its security protocol; each node gets a port for each.
    pub listeners: Vec<(String, String)>,
    /// The port each node advertises for `PLAINTEXT` instead of its own (a proxy's).
    pub advertised: Option<Vec<u16>>,
    /// More `kafka-storage format` arguments (e.g. `--add-scram`).
    pub format_args: Vec<String>,
}

/// One node: its ports and files, and its process while it runs.
pub struct KafkaNode {
    pub id: i32,
    /// The `PLAINTEXT` listener's port.
    pub port: u16,
    /// The ports of [`KafkaOptions::listeners`], in their order.
    pub listener_ports: Vec<u16>,
    config: PathBuf,
    log: PathBuf,
    format_args: String,
    child: Option<Child>,
}

/// A cluster of [`KafkaNode`]s in a temporary directory, killed when dropped.
pub struct KafkaCluster {
    pub nodes: Vec<KafkaNode>,
    dir: tempfile::TempDir,
}

impl KafkaCluster {
    /// Starts the nodes and waits until every broker is in the cluster's metadata.
    pub fn start(options: KafkaOptions) -> KafkaCluster {
        let dir = tempfile::tempdir().unwrap();
        let n = options.nodes.max(1);
        let ports: Vec<(u16, u16, Vec<u16>)> = (0..n)
            .map(|_| {
                let extra = options
                    .listeners
                    .iter()
                    .map(|_| super::free_port())
                    .collect();
                (super::free_port(), super::free_port(), extra)
            })
            .collect();
        let voters = ports
            .iter()
            .enumerate()
            .map(|(i, (_, c, _))| format!("{}@127.0.0.1:{c}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let (rf, isr) = if n >= 3 { (3, 2) } else { (n, 1) };
        let suite =
            std::fs::read_to_string(super::repo_root().join("scripts/kafka/test.properties"))
                .expect("scripts/kafka/test.properties");
        let mut nodes = Vec::new();
        for (i, (port, cport, extra)) in ports.into_iter().enumerate() {
            let id = i as i32 + 1;
            let advertised_port = options.advertised.as_ref().map_or(port, |a| a[i]);
            let mut listeners = vec![
                format!("PLAINTEXT://127.0.0.1:{port}"),
                format!("CONTROLLER://127.0.0.1:{cport}"),
            ];
            let mut advertised = vec![format!("PLAINTEXT://127.0.0.1:{advertised_port}")];
            let mut protocols = vec![
                "PLAINTEXT:PLAINTEXT".to_owned(),
                "CONTROLLER:PLAINTEXT".to_owned(),
            ];
            for ((name, protocol), p) in options.listeners.iter().zip(&extra) {
                listeners.push(format!("{name}://127.0.0.1:{p}"));
                advertised.push(format!("{name}://127.0.0.1:{p}"));
                protocols.push(format!("{name}:{protocol}"));
            }
            let node_dir = dir.path().join(format!("node-{id}"));
            std::fs::create_dir_all(&node_dir).unwrap();
            let mut text = format!(
                "process.roles=broker,controller\nnode.id={id}\ncontroller.quorum.voters={voters}\n\
                 controller.listener.names=CONTROLLER\ninter.broker.listener.name=PLAINTEXT\n\
                 listeners={}\nadvertised.listeners={}\nlistener.security.protocol.map={}\n\
                 log.dirs={}\noffsets.topic.replication.factor={rf}\n\
                 transaction.state.log.replication.factor={rf}\ntransaction.state.log.min.isr={isr}\n\
                 default.replication.factor={rf}\nmin.insync.replicas={isr}\n{suite}\n",
                listeners.join(","),
                advertised.join(","),
                protocols.join(","),
                node_dir.join("data").display(),
            );
            for (k, v) in &options.props {
                text.push_str(&format!("{k}={v}\n"));
            }
            let config = node_dir.join("server.properties");
            std::fs::write(&config, text).unwrap();
            nodes.push(KafkaNode {
                id,
                port,
                listener_ports: extra,
                config,
                log: node_dir.join("kafka.log"),
                format_args: options.format_args.join(" "),
                child: None,
            });
        }
        let mut cluster = KafkaCluster { nodes, dir };
        for node in &mut cluster.nodes {
            node.spawn();
        }
        for node in &cluster.nodes {
            node.wait_started();
        }
        cluster.wait_brokers(n);
        cluster
    }

    /// The `PLAINTEXT` listeners of every node, as a bootstrap list.
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn node(&mut self, id: i32) -> &mut KafkaNode {
        self.nodes.iter_mut().find(|n| n.id == id).unwrap()
    }

    /// Waits until the metadata names `n` brokers.
    pub fn wait_brokers(&self, n: usize) {
        let consumer = self.client();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(m) = consumer.fetch_metadata(None, Duration::from_secs(5))
                && m.brokers().len() >= n
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach {n} brokers"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The leader of `topic`'s partition, when it has one.
    pub fn leader(&self, topic: &str, partition: i32) -> Option<i32> {
        let m = self
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .ok()?;
        let p = m
            .topics()
            .first()?
            .partitions()
            .iter()
            .find(|p| p.id() == partition)?;
        (p.leader() >= 0).then_some(p.leader())
    }

    /// Waits until every partition of `topic` has a leader and all `replicas` in sync.
    pub fn wait_in_sync(&self, topic: &str, replicas: usize) {
        let consumer = self.client();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(m) = consumer.fetch_metadata(Some(topic), Duration::from_secs(5))
                && let Some(t) = m.topics().first()
                && !t.partitions().is_empty()
                && t.partitions()
                    .iter()
                    .all(|p| p.leader() >= 0 && p.isr().len() >= replicas)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{topic} did not get {replicas} replicas in sync"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn client(&self) -> BaseConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .unwrap()
    }
}

impl KafkaNode {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(super::repo_root().join("scripts/kafka.sh"))
            .arg("run")
            .arg(&self.config)
            .env("KAFKA_HEAP_OPTS", "-Xmx512m")
            .env("KAFKA_FORMAT_ARGS", &self.format_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// How many times the log says this node started.
    fn starts(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .matches("Kafka Server started")
            .count()
    }

    fn wait_started(&self) {
        self.wait_starts(1);
    }

    fn wait_starts(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.starts() < n {
            assert!(
                Instant::now() < deadline,
                "Kafka node {} did not start: {}",
                self.id,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL: the node goes without a word to the others.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and waits for it to end: a controlled shutdown, which moves the leadership of
    /// its partitions to the others first.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(60);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Starts a stopped or killed node again with its data, and waits until it runs.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "node {} still runs", self.id);
        let before = self.starts();
        self.spawn();
        self.wait_starts(before + 1);
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }
}

/// Runs one of Kafka's command-line tools (`scripts/kafka.sh TOOL ARGS`); returns whether it
/// succeeded and what it printed (stdout, then stderr).
pub fn kafka_tool(tool: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(super::repo_root().join("scripts/kafka.sh"))
        .arg(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/kafka.sh {tool}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}
